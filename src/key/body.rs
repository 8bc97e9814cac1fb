//! Reading a request's body before the decision: [`ReadBody`] reads the
//! start of the body before the rate-limit layer decides, and gives the
//! body back whole (or as the layer rewrote it); keys and costs read what
//! it read ([`JsonField`](super::JsonField), `super::json`).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::Request;
use http_body::{Body, Frame, SizeHint};
use http_body_util::BodyExt;
use pin_project_lite::pin_project;

/// The default of [`ReadBody::max_bytes`]: 16 KiB.
pub const DEFAULT_MAX_BODY: usize = 16 * 1024;
/// The default of [`ReadBody::timeout`]: 5 s.
pub const DEFAULT_BODY_TIMEOUT: Duration = Duration::from_secs(5);

/// What [`ReadBody`] read: the whole body, or `None` when it was longer
/// than the bound, too slow, or failed; and the body to forward instead,
/// when the rate-limit layer wrote a field into it (see `write_cost` in `key/json.rs`),
/// shared with the [`ReplayBody`] that gives the body back.
#[derive(Clone)]
pub(super) struct BodyRead(pub(super) Option<Bytes>, pub(super) Rewrite);

/// The body a [`ReplayBody`] gives back instead of what was read, set
/// before the body is forwarded.
pub(super) type Rewrite = Arc<std::sync::Mutex<Option<Bytes>>>;

/// A Tower layer that reads the start of each request's body, at most
/// [`max_bytes`](Self::max_bytes) within [`timeout`](Self::timeout), for
/// keys such as [`JsonField`](super::JsonField) to read, and gives the inner service the body
/// back unchanged (the bytes read, then the rest). Put it around the
/// rate-limit layer with [`around`](Self::around): keys are read before the
/// decision.
///
/// A body over the bound (by its `Content-Length`, then not read at all, or
/// as it arrives), one that is not whole within the timeout (a client
/// sending slowly holds the request at most that long before the decision),
/// or one that fails has no key: the rule's
/// [`MissingKey`](crate::layer::MissingKey) applies (400 by default). So
/// the bound caps both the memory a request holds before it is limited and
/// the time: what was read is copied into one buffer of at most
/// `max_bytes` (and the one chunk that went over it), however the body is
/// cut into chunks, and given back as one frame.
///
/// The body is read before any limit of the layer inside: a flood of
/// bodies is read (each up to the bound and the timeout) before one is
/// refused. Put the limit keyed by the client IP in a layer of its own
/// outside `ReadBody`, so that it refuses before anything is read, and the
/// rules keyed by the body inside:
///
/// ```
/// # #[cfg(feature = "axum")] {
/// use axum::{routing::post, Router};
/// use tower_ratelimit::key::{ClientIp, JsonField, ReadBody};
/// use tower_ratelimit::layer::RateLimitLayer;
/// use tower_ratelimit::{Limit, Quota};
///
/// let per_ip = RateLimitLayer::builder()
///     .limit(Limit::new("login-ip", Quota::per_minute(30).sliding_log())?, ClientIp::peer())
///     .build()?;
/// let per_user = RateLimitLayer::builder()
///     .limit(Limit::new("login", Quota::per_minute(5).sliding_log())?, JsonField::new("username"))
///     .build()?;
/// let app: Router = Router::new().route(
///     "/login",
///     post(|body: String| async move { body })
///         .route_layer(ReadBody::new().max_bytes(4096).around(per_user))
///         // added last, runs first: nothing is read beyond the per-IP limit
///         .route_layer(per_ip),
/// );
/// # }
/// # Ok::<(), tower_ratelimit::ConfigError>(())
/// ```
///
/// The inner service's body type `B` is the layer's: it must be made from a
/// [`ReplayBody<B>`] (axum's `Body` is, with the `axum` feature).
#[derive(Debug, Clone, Copy)]
pub struct ReadBody {
    max_bytes: usize,
    timeout: Duration,
}

impl Default for ReadBody {
    fn default() -> Self {
        Self {
            max_bytes: DEFAULT_MAX_BODY,
            timeout: DEFAULT_BODY_TIMEOUT,
        }
    }
}

impl ReadBody {
    /// At most [`DEFAULT_MAX_BODY`] within [`DEFAULT_BODY_TIMEOUT`].
    pub fn new() -> Self {
        Self::default()
    }

    /// The most bytes read; a longer body has no key.
    pub fn max_bytes(mut self, bytes: usize) -> Self {
        self.max_bytes = bytes;
        self
    }

    /// How long the body may take to arrive; a slower one has no key.
    pub fn timeout(mut self, wait: Duration) -> Self {
        self.timeout = wait;
        self
    }

    /// `layer` with this one around it: the body is read, then `layer`
    /// decides. The one value to give axum's `Router::layer` (or
    /// `route_layer`).
    pub fn around<L>(self, layer: L) -> tower_layer::Stack<L, ReadBody> {
        tower_layer::Stack::new(layer, self)
    }

    /// Reads the start of `body`: the whole of it, or `None`; and the body
    /// to forward.
    ///
    /// The data is copied into one buffer as it arrives, never more than
    /// `max_bytes` of it: the chunks are not kept, since each one can hold
    /// far more memory than its bytes (a body dripped a byte per segment
    /// holds hundreds of bytes per byte as hyper's chunks). The chunk that
    /// goes over the bound is kept as it is, and is the only one.
    async fn read<B>(self, mut body: B) -> (Option<Bytes>, Rewrite, B)
    where
        B: Body<Data = Bytes> + From<ReplayBody<B>> + Unpin,
    {
        let expected = body.size_hint().lower();
        if expected > self.max_bytes as u64 {
            return (None, Rewrite::default(), body);
        }
        let deadline = tokio::time::Instant::now() + self.timeout;
        // (at most max_bytes: checked above)
        let mut buffer = Vec::with_capacity(usize::try_from(expected).unwrap_or(0));
        let mut over = None;
        // (whole, a frame or error to give back after the data, ended)
        let (whole, after, ended) = loop {
            match tokio::time::timeout_at(deadline, body.frame()).await {
                Err(_) => break (false, None, false),
                Ok(None) => break (true, None, true),
                Ok(Some(Ok(frame))) => match frame.into_data() {
                    Ok(data) => {
                        if buffer.len() + data.len() > self.max_bytes {
                            over = Some(data);
                            break (false, None, false);
                        }
                        append(&mut buffer, &data, self.max_bytes);
                    }
                    // trailers: the data is whole
                    Err(frame) => break (true, Some(Ok(frame)), false),
                },
                Ok(Some(Err(error))) => break (false, Some(Err(error)), true),
            }
        };
        let buffer = Bytes::from(buffer);
        let read = whole.then(|| buffer.clone());
        let rest = (!ended).then_some(body);
        let rewrite = Rewrite::default();
        let replay = ReplayBody {
            // (a body read whole may be rewritten; an empty one is no JSON
            // object, never rewritten)
            read: (!buffer.is_empty()).then_some(buffer),
            rewrite: whole.then(|| rewrite.clone()),
            over,
            after,
            rest,
        };
        (read, rewrite, B::from(replay))
    }
}

/// Appends `data` to `buffer`, growing it (doubling, at least to 256
/// bytes) to at most `max` bytes of capacity; `buffer.len() + data.len()`
/// is at most `max`.
fn append(buffer: &mut Vec<u8>, data: &[u8], max: usize) {
    let needed = buffer.len() + data.len();
    if needed > buffer.capacity() {
        let target = needed.max(buffer.capacity() * 2).max(256).min(max);
        buffer.reserve_exact(target.max(needed) - buffer.len());
    }
    buffer.extend_from_slice(data);
}

impl<S> tower_layer::Layer<S> for ReadBody {
    type Service = ReadBodyService<S>;

    fn layer(&self, inner: S) -> ReadBodyService<S> {
        ReadBodyService { inner, read: *self }
    }
}

/// The service of [`ReadBody`].
#[derive(Debug, Clone)]
pub struct ReadBodyService<S> {
    inner: S,
    read: ReadBody,
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

impl<S, B> tower_service::Service<Request<B>> for ReadBodyService<S>
where
    S: tower_service::Service<Request<B>> + Clone + Send + 'static,
    S::Future: Send,
    B: Body<Data = Bytes> + From<ReplayBody<B>> + Unpin + Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = BoxFuture<Result<S::Response, S::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<B>) -> Self::Future {
        // the clone that was made ready calls; a fresh one waits its turn
        let fresh = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, fresh);
        let read = self.read;
        Box::pin(async move {
            let (mut parts, body) = request.into_parts();
            let (bytes, rewrite, body) = read.read(body).await;
            parts.extensions.insert(BodyRead(bytes, rewrite));
            inner.call(Request::from_parts(parts, body)).await
        })
    }
}

pin_project! {
    /// A body given back by [`ReadBody`]: what it read, as one frame (and
    /// the chunk that went over its bound, if one did), then the rest of
    /// the original body, frame for frame. When the rate-limit layer wrote
    /// a request's cost into the body it read whole
    /// ([`Rule::cost_from_request_json`](crate::layer::Rule::cost_from_request_json)
    /// with [`settle_estimates`](crate::layer::Rule::settle_estimates)),
    /// that body instead of what was read.
    pub struct ReplayBody<B: Body> {
        read: Option<Bytes>,
        rewrite: Option<Rewrite>,
        over: Option<Bytes>,
        after: Option<Result<Frame<Bytes>, B::Error>>,
        #[pin]
        rest: Option<B>,
    }
}

impl<B: Body<Data = Bytes>> Body for ReplayBody<B> {
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        let this = self.project();
        if let Some(mut data) = this.read.take() {
            if let Some(rewritten) = this
                .rewrite
                .take()
                .and_then(|r| crate::sync::lock(&r).take())
            {
                data = rewritten;
            }
            return Poll::Ready(Some(Ok(Frame::data(data))));
        }
        if let Some(data) = this.over.take() {
            return Poll::Ready(Some(Ok(Frame::data(data))));
        }
        if let Some(after) = this.after.take() {
            return Poll::Ready(Some(after));
        }
        match this.rest.as_pin_mut() {
            Some(rest) => rest.poll_frame(cx),
            None => Poll::Ready(None),
        }
    }

    fn is_end_stream(&self) -> bool {
        self.read.is_none()
            && self.over.is_none()
            && self.after.is_none()
            && self.rest.as_ref().is_none_or(Body::is_end_stream)
    }

    fn size_hint(&self) -> SizeHint {
        let rewritten =
            (self.rewrite.as_ref()).and_then(|r| crate::sync::lock(r).as_ref().map(Bytes::len));
        let first = rewritten.or(self.read.as_ref().map(Bytes::len));
        let read = (first.into_iter())
            .chain(self.over.as_ref().map(Bytes::len))
            .map(|len| len as u64)
            .sum();
        let Some(rest) = &self.rest else {
            return SizeHint::with_exact(read);
        };
        let rest = rest.size_hint();
        let mut hint = SizeHint::new();
        hint.set_lower(rest.lower().saturating_add(read));
        if let Some(upper) = rest.upper() {
            hint.set_upper(upper.saturating_add(read));
        }
        hint
    }
}

#[cfg(feature = "axum")]
#[cfg_attr(docsrs, doc(cfg(feature = "axum")))]
impl From<ReplayBody<axum::body::Body>> for axum::body::Body {
    fn from(body: ReplayBody<axum::body::Body>) -> Self {
        axum::body::Body::new(body)
    }
}
