//! The response body: the inner service's, or a rejection's.

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full};
use pin_project_lite::pin_project;

use super::after::After;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The body of a rejection: the layer's own problem details, or whatever a
/// custom rejection handler returned, boxed. Needs no web framework, so the
/// layer works over any `http` service with or without the `axum` feature.
pub(crate) struct RejectionBody(UnsyncBoxBody<Bytes, BoxError>);

/// A rejection response.
pub(crate) type RejectionResponse = http::Response<RejectionBody>;

impl RejectionBody {
    /// Boxes any body with `Bytes` frames (an `axum::body::Body`, a `Full`).
    pub(crate) fn new<B>(body: B) -> Self
    where
        B: Body<Data = Bytes> + Send + 'static,
        B::Error: Into<BoxError>,
    {
        Self(body.map_err(Into::into).boxed_unsync())
    }
}

impl From<String> for RejectionBody {
    fn from(text: String) -> Self {
        Self::new(Full::new(Bytes::from(text)))
    }
}

impl Body for RejectionBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        Pin::new(&mut self.0).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.0.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.0.size_hint()
    }
}

/// The error that ends a response body whose concurrency permit was given
/// back: held for its [maximum hold](crate::Limit::hold_at_most), or by a
/// client that stopped reading for the lease time.
#[derive(Debug)]
struct HeldTooLong;

impl std::fmt::Display for HeldTooLong {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(
            "the response's concurrency permit was given back: held for its maximum hold, \
             or by a client that stopped reading for the lease time",
        )
    }
}

impl std::error::Error for HeldTooLong {}

pin_project! {
    /// Body of a response from [`RateLimit`](super::RateLimit): the inner
    /// service's body, or the body of a rejection (429, 503, missing key).
    pub struct ResponseBody<B> {
        #[pin]
        kind: Kind<B>,
        // What to settle when the body ends or is dropped.
        after: Option<Box<After>>,
    }
}

pin_project! {
    #[project = KindProj]
    enum Kind<B> {
        Inner { #[pin] body: B },
        Rejection { #[pin] body: RejectionBody },
    }
}

impl<B> ResponseBody<B> {
    pub(crate) fn inner(body: B) -> Self {
        Self {
            kind: Kind::Inner { body },
            after: None,
        }
    }

    /// The inner service's body, with what to settle when it ends.
    pub(crate) fn settled_after(body: B, after: Option<Box<After>>) -> Self {
        Self {
            kind: Kind::Inner { body },
            after,
        }
    }

    pub(crate) fn rejection(body: RejectionBody) -> Self {
        Self {
            kind: Kind::Rejection { body },
            after: None,
        }
    }
}

/// Polls the body of `kind` for its next frame.
fn poll_kind<B>(
    kind: Pin<&mut Kind<B>>,
    cx: &mut Context<'_>,
) -> Poll<Option<Result<Frame<Bytes>, BoxError>>>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    match kind.project() {
        KindProj::Inner { body } => body.poll_frame(cx).map_err(Into::into),
        KindProj::Rejection { body } => body.poll_frame(cx).map_err(Into::into),
    }
}

impl<B> Body for ResponseBody<B>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.project();
        if this
            .after
            .as_ref()
            .is_some_and(|after| after.held_too_long())
        {
            // the permit was given back: the body ends, and the connection
            // with it (see `Limit::hold_at_most`)
            *this.after = None;
            return Poll::Ready(Some(Err(HeldTooLong.into())));
        }
        // with a lease, the inner body is polled with a waker that tells it
        // when the body's data is ready (see `LeaseGuard::data_ready_of`)
        let frame = match this
            .after
            .as_mut()
            .and_then(|after| after.waker(cx.waker()))
        {
            Some(ours) => poll_kind(this.kind, &mut Context::from_waker(&ours)),
            None => poll_kind(this.kind, cx),
        };
        match &frame {
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(after) = this.after.as_mut() {
                    // a client that reads asks for the next one soon
                    after.handed_over();
                    if let Some(data) = frame.data_ref() {
                        after.count(data);
                    }
                }
            }
            // ended: settled now, not when the body is dropped
            Poll::Ready(_) => *this.after = None,
            Poll::Pending => {
                if let Some(after) = this.after.as_ref() {
                    after.waiting();
                    after.wake_on_expiry(cx.waker());
                }
            }
        }
        frame
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            Kind::Inner { body } => body.is_end_stream(),
            Kind::Rejection { body } => body.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            Kind::Inner { body } => body.size_hint(),
            Kind::Rejection { body } => body.size_hint(),
        }
    }
}
