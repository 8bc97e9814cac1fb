//! Envoy's rate limit protocol: the messages of `envoy.service.ratelimit.v3`
//! (`rls.proto`) and of the few packages they use, written as prost structs
//! with the field numbers of envoyproxy/envoy's `.proto` files, plus the gRPC
//! plumbing of `RateLimitService/ShouldRateLimit` (a server and a client).
//!
//! Written by hand rather than taken from the `envoy-types` crate: that crate
//! compiles every Envoy API (about 89 thousand lines of generated code) for
//! these ten messages, which costs each CI build far more than it brings.
//! Field numbers: `api/envoy/service/ratelimit/v3/rls.proto`,
//! `api/envoy/extensions/common/ratelimit/v3/ratelimit.proto`,
//! `api/envoy/config/core/v3/base.proto` and
//! `api/envoy/type/v3/ratelimit_unit.proto` of envoyproxy/envoy.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

/// `google.protobuf.Duration`.
pub use prost_types::Duration;
/// `google.protobuf.Struct` (the response's `dynamic_metadata`).
pub use prost_types::Struct;
/// `google.protobuf.Timestamp` (a quota's `valid_until`).
pub use prost_types::Timestamp;

/// The full gRPC name of the service.
pub const SERVICE_NAME: &str = "envoy.service.ratelimit.v3.RateLimitService";

/// The HTTP/2 path of the one method, `ShouldRateLimit`.
pub const SHOULD_RATE_LIMIT_PATH: &str =
    "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit";

/// `envoy.service.ratelimit.v3.RateLimitRequest`: the descriptors of one
/// request of one domain.
#[derive(Clone, PartialEq, prost::Message)]
pub struct RateLimitRequest {
    /// The domain (a namespace of the configuration).
    #[prost(string, tag = "1")]
    pub domain: String,
    /// The descriptors, each decided on its own limit.
    #[prost(message, repeated, tag = "2")]
    pub descriptors: Vec<RateLimitDescriptor>,
    /// Hits to take from every descriptor; 0 means 1 (unless a descriptor
    /// sets its own `hits_addend`).
    #[prost(uint32, tag = "3")]
    pub hits_addend: u32,
}

/// `envoy.extensions.common.ratelimit.v3.RateLimitDescriptor`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct RateLimitDescriptor {
    /// The descriptor's key/value pairs, in order.
    #[prost(message, repeated, tag = "1")]
    pub entries: Vec<rate_limit_descriptor::Entry>,
    /// A limit sent with the request, overriding the configuration's.
    #[prost(message, optional, tag = "2")]
    pub limit: Option<rate_limit_descriptor::RateLimitOverride>,
    /// This descriptor's hits (`google.protobuf.UInt64Value`: absent means
    /// the request's `hits_addend`; 0 is a check that takes nothing).
    #[prost(message, optional, tag = "3")]
    pub hits_addend: Option<u64>,
    /// The hits are a refund: given back, not taken.
    #[prost(bool, tag = "4")]
    pub is_negative_hits: bool,
}

/// The nested messages of [`RateLimitDescriptor`].
pub mod rate_limit_descriptor {
    /// `RateLimitDescriptor.Entry`: one key/value pair.
    #[derive(Clone, PartialEq, Eq, Hash, prost::Message)]
    pub struct Entry {
        /// The key.
        #[prost(string, tag = "1")]
        pub key: String,
        /// The value.
        #[prost(string, tag = "2")]
        pub value: String,
    }

    /// `RateLimitDescriptor.RateLimitOverride`: a limit chosen by the client.
    #[derive(Clone, Copy, PartialEq, Eq, Hash, prost::Message)]
    pub struct RateLimitOverride {
        /// Requests per unit.
        #[prost(uint32, tag = "1")]
        pub requests_per_unit: u32,
        /// The unit (`envoy.type.v3.RateLimitUnit`, numbered as
        /// [`super::rate_limit_response::rate_limit::Unit`]).
        #[prost(
            enumeration = "super::rate_limit_response::rate_limit::Unit",
            tag = "2"
        )]
        pub unit: i32,
    }
}

/// `envoy.service.ratelimit.v3.RateLimitResponse`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct RateLimitResponse {
    /// `OVER_LIMIT` if any descriptor is over its limit, else `OK`.
    #[prost(enumeration = "rate_limit_response::Code", tag = "1")]
    pub overall_code: i32,
    /// One status per descriptor of the request, in its order.
    #[prost(message, repeated, tag = "2")]
    pub statuses: Vec<rate_limit_response::DescriptorStatus>,
    /// Headers Envoy adds to the response sent downstream.
    #[prost(message, repeated, tag = "3")]
    pub response_headers_to_add: Vec<HeaderValue>,
    /// Headers Envoy adds to the request sent upstream.
    #[prost(message, repeated, tag = "4")]
    pub request_headers_to_add: Vec<HeaderValue>,
    /// A body for the refusal (unused here).
    #[prost(bytes = "vec", tag = "5")]
    pub raw_body: Vec<u8>,
    /// Dynamic metadata Envoy records for the request.
    #[prost(message, optional, tag = "6")]
    pub dynamic_metadata: Option<Struct>,
    /// A quota handed out for the whole request (unused here).
    #[prost(message, optional, tag = "7")]
    pub quota: Option<rate_limit_response::Quota>,
}

/// The nested messages and enums of [`RateLimitResponse`].
pub mod rate_limit_response {
    /// `RateLimitResponse.Code`.
    #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, prost::Enumeration)]
    #[repr(i32)]
    pub enum Code {
        /// Not decided.
        Unknown = 0,
        /// Within the limit.
        Ok = 1,
        /// Over the limit.
        OverLimit = 2,
    }

    /// `RateLimitResponse.RateLimit`: a limit as reported to Envoy.
    #[derive(Clone, PartialEq, Eq, Hash, prost::Message)]
    pub struct RateLimit {
        /// Requests per unit.
        #[prost(uint32, tag = "1")]
        pub requests_per_unit: u32,
        /// The unit.
        #[prost(enumeration = "rate_limit::Unit", tag = "2")]
        pub unit: i32,
        /// The limit's name, if it has one.
        #[prost(string, tag = "3")]
        pub name: String,
    }

    /// The enum of [`RateLimit`].
    pub mod rate_limit {
        /// `RateLimitResponse.RateLimit.Unit` (also `envoy.type.v3.RateLimitUnit`,
        /// which has the same numbers and no `WEEK`).
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, prost::Enumeration)]
        #[repr(i32)]
        pub enum Unit {
            /// No unit.
            Unknown = 0,
            /// A second.
            Second = 1,
            /// A minute.
            Minute = 2,
            /// An hour.
            Hour = 3,
            /// A day.
            Day = 4,
            /// A month.
            Month = 5,
            /// A year.
            Year = 6,
            /// A week.
            Week = 7,
        }

        impl Unit {
            /// Its name in the `.proto` file (`SECOND`, ...).
            pub fn as_str_name(&self) -> &'static str {
                match self {
                    Unit::Unknown => "UNKNOWN",
                    Unit::Second => "SECOND",
                    Unit::Minute => "MINUTE",
                    Unit::Hour => "HOUR",
                    Unit::Day => "DAY",
                    Unit::Month => "MONTH",
                    Unit::Year => "YEAR",
                    Unit::Week => "WEEK",
                }
            }
        }
    }

    /// `RateLimitResponse.Quota` (not handed out by this server).
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Quota {
        /// Requests granted.
        #[prost(uint32, tag = "1")]
        pub requests: u32,
        /// Until when (`expiration_specifier.valid_until`).
        #[prost(message, optional, tag = "2")]
        pub valid_until: Option<super::Timestamp>,
        /// The quota's id.
        #[prost(string, tag = "3")]
        pub id: String,
    }

    /// `RateLimitResponse.DescriptorStatus`: the answer for one descriptor.
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct DescriptorStatus {
        /// `OK` or `OVER_LIMIT`.
        #[prost(enumeration = "Code", tag = "1")]
        pub code: i32,
        /// The limit the descriptor matched (absent: no limit).
        #[prost(message, optional, tag = "2")]
        pub current_limit: Option<RateLimit>,
        /// What is left of the limit in the current window.
        #[prost(uint32, tag = "3")]
        pub limit_remaining: u32,
        /// Time until the window resets.
        #[prost(message, optional, tag = "4")]
        pub duration_until_reset: Option<super::Duration>,
        /// A quota handed out for this descriptor (unused here).
        #[prost(message, optional, tag = "5")]
        pub quota: Option<Quota>,
    }
}

/// `envoy.config.core.v3.HeaderValue`: one header.
#[derive(Clone, PartialEq, Eq, Hash, prost::Message)]
pub struct HeaderValue {
    /// The name.
    #[prost(string, tag = "1")]
    pub key: String,
    /// The value.
    #[prost(string, tag = "2")]
    pub value: String,
    /// The value as bytes (used instead of `value` when not empty).
    #[prost(bytes = "vec", tag = "3")]
    pub raw_value: Vec<u8>,
}

/// The server side of `RateLimitService`: what a handler implements.
pub trait RateLimitService: Send + Sync + 'static {
    /// Answers one `ShouldRateLimit` call.
    fn should_rate_limit(
        &self,
        request: tonic::Request<RateLimitRequest>,
    ) -> impl Future<Output = Result<tonic::Response<RateLimitResponse>, tonic::Status>> + Send;
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send + 'static>>;

/// A gRPC service (for tonic's transport or any tower stack) that routes
/// `ShouldRateLimit` to a [`RateLimitService`]; any other path answers
/// `UNIMPLEMENTED`.
#[derive(Debug)]
pub struct RateLimitServiceServer<T> {
    inner: Arc<T>,
    max_decoding_message_size: Option<usize>,
}

impl<T> Clone for RateLimitServiceServer<T> {
    fn clone(&self) -> Self {
        Self {
            inner: Arc::clone(&self.inner),
            max_decoding_message_size: self.max_decoding_message_size,
        }
    }
}

impl<T: RateLimitService> RateLimitServiceServer<T> {
    /// Serves `inner`.
    pub fn new(inner: T) -> Self {
        Self::from_arc(Arc::new(inner))
    }

    /// Serves a shared `inner`.
    pub fn from_arc(inner: Arc<T>) -> Self {
        Self {
            inner,
            max_decoding_message_size: None,
        }
    }

    /// The largest request accepted, in bytes (tonic's default: 4 MiB).
    pub fn max_decoding_message_size(mut self, limit: usize) -> Self {
        self.max_decoding_message_size = Some(limit);
        self
    }
}

impl<T> tonic::server::NamedService for RateLimitServiceServer<T> {
    const NAME: &'static str = SERVICE_NAME;
}

struct ShouldRateLimit<T>(Arc<T>);

impl<T: RateLimitService> tonic::server::UnaryService<RateLimitRequest> for ShouldRateLimit<T> {
    type Response = RateLimitResponse;
    type Future = BoxFuture<Result<tonic::Response<RateLimitResponse>, tonic::Status>>;

    fn call(&mut self, request: tonic::Request<RateLimitRequest>) -> Self::Future {
        let inner = Arc::clone(&self.0);
        Box::pin(async move { inner.should_rate_limit(request).await })
    }
}

impl<T, B> tower_service::Service<http::Request<B>> for RateLimitServiceServer<T>
where
    T: RateLimitService,
    B: http_body::Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync + 'static>> + Send + 'static,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = std::convert::Infallible;
    type Future = BoxFuture<Result<Self::Response, Self::Error>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        if request.uri().path() != SHOULD_RATE_LIMIT_PATH {
            return Box::pin(async {
                Ok(tonic::Status::unimplemented("").into_http::<tonic::body::Body>())
            });
        }
        let method = ShouldRateLimit(Arc::clone(&self.inner));
        let max = self.max_decoding_message_size;
        Box::pin(async move {
            let codec = tonic_prost::ProstCodec::<RateLimitResponse, RateLimitRequest>::default();
            let mut grpc = tonic::server::Grpc::new(codec).apply_max_message_size_config(max, None);
            Ok(grpc.unary(method, request).await)
        })
    }
}

/// A client of `RateLimitService` (tests, the benchmark, `POST /json`).
#[derive(Debug, Clone)]
pub struct RateLimitServiceClient<T> {
    inner: tonic::client::Grpc<T>,
}

impl RateLimitServiceClient<tonic::transport::Channel> {
    /// Connects to `dst` (`http://host:port`).
    pub async fn connect<D>(dst: D) -> Result<Self, tonic::transport::Error>
    where
        D: TryInto<tonic::transport::Endpoint>,
        D::Error: Into<Box<dyn std::error::Error + Send + Sync + 'static>>,
    {
        let channel = tonic::transport::Endpoint::new(dst)?.connect().await?;
        Ok(Self::new(channel))
    }
}

impl<T> RateLimitServiceClient<T>
where
    T: tonic::client::GrpcService<tonic::body::Body>,
    T::Error: Into<Box<dyn std::error::Error + Send + Sync + 'static>>,
    T::ResponseBody: http_body::Body<Data = bytes::Bytes> + Send + 'static,
    <T::ResponseBody as http_body::Body>::Error:
        Into<Box<dyn std::error::Error + Send + Sync + 'static>> + Send,
{
    /// A client over any gRPC transport (a `Channel`, a tower stack).
    pub fn new(inner: T) -> Self {
        Self {
            inner: tonic::client::Grpc::new(inner),
        }
    }

    /// Calls `ShouldRateLimit`.
    pub async fn should_rate_limit(
        &mut self,
        request: impl tonic::IntoRequest<RateLimitRequest>,
    ) -> Result<tonic::Response<RateLimitResponse>, tonic::Status> {
        self.inner
            .ready()
            .await
            .map_err(|e| tonic::Status::unavailable(format!("not ready: {}", e.into())))?;
        let codec = tonic_prost::ProstCodec::<RateLimitRequest, RateLimitResponse>::default();
        let path = http::uri::PathAndQuery::from_static(SHOULD_RATE_LIMIT_PATH);
        self.inner.unary(request.into_request(), path, codec).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use prost::Message;

    #[test]
    fn field_numbers_match_the_proto() {
        // domain = 1 ("d"), descriptors = 2 { entries = 1 { key = 1, value = 2 },
        // hits_addend = 3 (UInt64Value { value = 1 }), is_negative_hits = 4 },
        // hits_addend = 3.
        let request = RateLimitRequest {
            domain: "d".into(),
            descriptors: vec![RateLimitDescriptor {
                entries: vec![rate_limit_descriptor::Entry {
                    key: "k".into(),
                    value: "v".into(),
                }],
                limit: None,
                hits_addend: Some(5),
                is_negative_hits: true,
            }],
            hits_addend: 2,
        };
        let bytes = request.encode_to_vec();
        let expected: &[u8] = &[
            0x0a, 1, b'd', // domain
            0x12, 14, // descriptors, 14 bytes
            0x0a, 6, 0x0a, 1, b'k', 0x12, 1, b'v', // entry
            0x1a, 2, 0x08, 5, // hits_addend { value: 5 }
            0x20, 1, // is_negative_hits
            0x18, 2, // hits_addend
        ];
        assert_eq!(bytes, expected);
        assert_eq!(RateLimitRequest::decode(expected).ok(), Some(request));
    }

    #[test]
    fn a_zero_descriptor_hits_addend_is_present() {
        let d = RateLimitDescriptor {
            hits_addend: Some(0),
            ..Default::default()
        };
        let back = RateLimitDescriptor::decode(d.encode_to_vec().as_slice()).ok();
        assert_eq!(back.and_then(|d| d.hits_addend), Some(0));
    }

    struct Echo;

    impl RateLimitService for Echo {
        async fn should_rate_limit(
            &self,
            request: tonic::Request<RateLimitRequest>,
        ) -> Result<tonic::Response<RateLimitResponse>, tonic::Status> {
            let request = request.into_inner();
            if request.domain.is_empty() {
                return Err(tonic::Status::invalid_argument("empty domain"));
            }
            Ok(tonic::Response::new(RateLimitResponse {
                overall_code: rate_limit_response::Code::OverLimit as i32,
                statuses: vec![Default::default(); request.descriptors.len()],
                ..Default::default()
            }))
        }
    }

    #[tokio::test]
    async fn a_call_goes_through_tonics_transport() -> Result<(), Box<dyn std::error::Error>> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let address = listener.local_addr()?;
        let incoming = tonic::transport::server::TcpIncoming::from(listener);
        let server = tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(RateLimitServiceServer::new(Echo))
                .serve_with_incoming(incoming),
        );
        let mut client = RateLimitServiceClient::connect(format!("http://{address}")).await?;
        let answer = client
            .should_rate_limit(RateLimitRequest {
                domain: "d".into(),
                descriptors: vec![Default::default(); 2],
                hits_addend: 0,
            })
            .await?
            .into_inner();
        assert_eq!(
            answer.overall_code,
            rate_limit_response::Code::OverLimit as i32
        );
        assert_eq!(answer.statuses.len(), 2);
        let refused = client
            .should_rate_limit(RateLimitRequest::default())
            .await
            .err()
            .map(|s| s.code());
        assert_eq!(refused, Some(tonic::Code::InvalidArgument));
        server.abort();
        Ok(())
    }
}
