//! The plans of one request, and the key of a resolved rule read from them.

use http::request::Parts;
use http::Extensions;
use smallvec::SmallVec;

use super::{Cached, LookupFailed, Plan, PlanResolver};
use crate::key::{KeyBuf, KeyExtractor};

/// The plans of one request, per resolver: put among its extensions when
/// the layer chooses its limits, and left there for the handler
/// ([`PlanResolver::found_in`]).
#[derive(Clone, Default)]
pub(crate) struct Resolved(pub(crate) SmallVec<[(u64, Result<Cached, LookupFailed>); 1]>);

impl Resolved {
    /// The plan `resolver` found for the request.
    pub(crate) fn of<'a>(parts: &'a Parts, resolver: &PlanResolver) -> Option<&'a Plan> {
        Self::among(&parts.extensions, resolver)
    }

    /// The plan `resolver` found, among a request's `extensions`.
    pub(crate) fn among<'a>(
        extensions: &'a Extensions,
        resolver: &PlanResolver,
    ) -> Option<&'a Plan> {
        let resolved = extensions.get::<Resolved>()?;
        let (_, found) = resolved.0.iter().find(|(id, _)| *id == resolver.0.id)?;
        found.as_ref().ok()?.as_deref()
    }
}

/// A resolved rule's key: the key of the plan its resolver found, or the
/// plan's key of that name.
pub(crate) struct PlanKey(pub(crate) PlanResolver, pub(crate) Option<Box<str>>);

impl PlanKey {
    /// The key of `parts`' plan this rule counts under.
    fn of<'a>(&self, parts: &'a Parts) -> Option<&'a [u8]> {
        let plan = Resolved::of(parts, &self.0)?;
        match &self.1 {
            None => Some(plan.key()),
            Some(name) => plan.key_named(name),
        }
    }
}

impl KeyExtractor for PlanKey {
    fn extract(&self, parts: &Parts) -> Option<Vec<u8>> {
        self.of(parts).map(<[u8]>::to_vec)
    }

    fn extract_into(&self, parts: &Parts, key: &mut KeyBuf) -> bool {
        match self.of(parts) {
            Some(found) => {
                key.extend_from_slice(found);
                true
            }
            None => false,
        }
    }

    fn key_kind(&self) -> String {
        match &self.1 {
            None => format!("Plan({})", self.0 .0.lookup_kind),
            Some(name) => format!("Plan({}).{name}", self.0 .0.lookup_kind),
        }
    }
}
