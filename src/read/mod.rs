//! Reading values out of bodies, for every reader of the crate: one JSON
//! reader ([`json`]: the value at a dotted path, skipping everything else
//! unparsed) and one event-stream reader ([`sse`]: server-sent events cut
//! into events as chunks arrive). The request's JSON body (keys and costs
//! read before the decision) and the response's JSON body or event stream
//! (costs settled after it) are read by these alone, with one path syntax.

pub(crate) mod json;
pub(crate) mod sse;

pub(crate) use self::json::{find, JsonPath, Number, Value};
