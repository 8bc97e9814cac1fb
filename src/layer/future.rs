//! The response future of the [`RateLimit`](super::RateLimit) service: the
//! inner service's own future (decided within `call`), the layer's answer,
//! or a boxed future that awaits the store first.

use std::future::Future;
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use http::Response;
use pin_project_lite::pin_project;

use super::ResponseBody;
use crate::fields::Fields;

pin_project! {
    /// The response future of [`RateLimit`](super::RateLimit).
    ///
    /// Over a store that answers at once (in memory), the layer decides
    /// inside `call` and this future is the inner service's own, plus the
    /// rate-limit fields to add, or the layer's answer; no box, no clone of
    /// the inner service. Otherwise it is a boxed `async` block: the store
    /// call is already a boxed future (stores are trait objects), so a
    /// second box costs one allocation and keeps the control flow (decide,
    /// wait, forward, decorate) readable top to bottom.
    pub struct ResponseFuture<F, B, E> {
        #[pin]
        state: State<F, B, E>,
    }
}

pin_project! {
    #[project = StateProj]
    enum State<F, B, E> {
        // Decided and forwarded: the inner service's future.
        Inner {
            #[pin]
            future: F,
            fields: Option<Fields>,
        },
        // Answered by the layer.
        Ready {
            result: Option<ResponseResult<B, E>>,
        },
        // Awaiting the store, a delay, a refund or the inner service's readiness.
        Boxed {
            future: Pin<Box<dyn Future<Output = ResponseResult<B, E>> + Send>>,
        },
    }
}

/// What the service gives for a request: the response, or the inner
/// service's error.
pub(super) type ResponseResult<B, E> = Result<Response<ResponseBody<B>>, E>;

impl<F, B, E> ResponseFuture<F, B, E> {
    /// The inner service's future, and the fields to add to its response.
    pub(super) fn inner(future: F, fields: Option<Fields>) -> Self {
        Self {
            state: State::Inner { future, fields },
        }
    }

    pub(super) fn ready(result: ResponseResult<B, E>) -> Self {
        let result = Some(result);
        Self {
            state: State::Ready { result },
        }
    }

    pub(super) fn boxed(
        future: impl Future<Output = ResponseResult<B, E>> + Send + 'static,
    ) -> Self {
        let future = Box::pin(future);
        Self {
            state: State::Boxed { future },
        }
    }
}

impl<F, B, E> Future for ResponseFuture<F, B, E>
where
    F: Future<Output = Result<Response<B>, E>>,
{
    type Output = ResponseResult<B, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.project().state.project() {
            StateProj::Inner { future, fields } => {
                let response = ready!(future.poll(cx))?;
                let mut response = response.map(ResponseBody::inner);
                if let Some(fields) = fields.take() {
                    fields.apply(response.headers_mut());
                }
                Poll::Ready(Ok(response))
            }
            StateProj::Ready { result } => match result.take() {
                Some(result) => Poll::Ready(result),
                // polled again after it completed: nothing more will come
                None => Poll::Pending,
            },
            StateProj::Boxed { future } => future.as_mut().poll(cx),
        }
    }
}

impl<F, B, E> std::fmt::Debug for ResponseFuture<F, B, E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ResponseFuture")
    }
}
