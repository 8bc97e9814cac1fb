//! [`RateLimitInfo`]: what the layer decided, for handlers, under every policy.

use crate::Decision;

/// What the rate-limit layer decided for this request: the way for a handler
/// to read the [`Decision`].
///
/// An axum extractor that never fails (with the `axum` feature; without it,
/// read it from the request extensions). The layer puts one in the extensions
/// of every request it forwards; a request that reached the handler without
/// a decision (the store failed under [`OnStoreError::FailOpen`], every limit
/// was skipped for a missing key, or no layer ran at all) still extracts,
/// with [`decision`](Self::decision) `None`.
///
/// ```
/// # #[cfg(feature = "axum")] {
/// use tower_ratelimit::layer::RateLimitInfo;
///
/// async fn hello(info: RateLimitInfo) -> String {
///     match info.decision() {
///         Some(decision) => format!("hello! {} left\n", decision.remaining()),
///         None => "hello!\n".to_owned(),
///     }
/// }
/// # let _ = axum::Router::<()>::new().route("/", axum::routing::get(hello));
/// # }
/// ```
///
/// This is the only extension the layer inserts (one insert per request: the
/// decision moves in, it is not copied). With nested layers, the info is
/// that of the innermost layer.
///
/// [`OnStoreError::FailOpen`]: super::OnStoreError::FailOpen
#[derive(Debug, Clone, Default)]
pub struct RateLimitInfo {
    decision: Option<Decision>,
    store_failed: bool,
}

impl RateLimitInfo {
    pub(crate) fn new(decision: Option<Decision>, store_failed: bool) -> Self {
        Self {
            decision,
            store_failed,
        }
    }

    /// The decision that let the request through; `None` when it passed
    /// without one (see the type's docs).
    pub fn decision(&self) -> Option<&Decision> {
        self.decision.as_ref()
    }

    /// The decision, owned.
    pub fn into_decision(self) -> Option<Decision> {
        self.decision
    }

    /// Whether the store failed for this request: it was then let through
    /// unlimited ([`OnStoreError::FailOpen`]) or decided by the in-memory
    /// fallback ([`OnStoreError::FallbackToMemory`]).
    ///
    /// [`OnStoreError::FailOpen`]: super::OnStoreError::FailOpen
    /// [`OnStoreError::FallbackToMemory`]: super::OnStoreError::FallbackToMemory
    pub fn store_failed(&self) -> bool {
        self.store_failed
    }
}

#[cfg(feature = "axum")]
#[cfg_attr(docsrs, doc(cfg(feature = "axum")))]
impl<S: Send + Sync> axum::extract::FromRequestParts<S> for RateLimitInfo {
    type Rejection = std::convert::Infallible;

    async fn from_request_parts(
        parts: &mut http::request::Parts,
        _state: &S,
    ) -> Result<Self, std::convert::Infallible> {
        Ok(parts
            .extensions
            .get::<RateLimitInfo>()
            .cloned()
            .unwrap_or_default())
    }
}
