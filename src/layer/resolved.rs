//! How it joins the layer: for a layer with a resolved rule, the response
//! future first asks each such rule's resolver for the request's plan (the
//! cache, or the lookup), and puts the answers among the request's
//! extensions (a private type, taken out again before the request goes on).
//! The rule's key extractor and tier choice then read them there, so the
//! rest of the layer (exemptions, the missing-key policy, tiers) applies to
//! a resolved rule as to any other. A lookup that fails under
//! `OnLookupError::FailClosed` is answered 503 before any limit is chosen.
//! A forwarded request carries what was found to the handler: the first
//! plan as a [`Plan`] extension, every resolver's through
//! [`PlanResolver::found_in`].

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use http::request::Parts;
use http::Response;

use super::refusal::rejection;
use super::response::Protocol;
use super::rule::Rule;
use super::{Config, Rejection, ResponseBody};
use crate::plan::{Plan, PlanKey, PlanResolver, Resolved};
use crate::ConfigError;

impl Rule {
    /// `limit`, counted per the key of each request's [`Plan`](crate::layer::Plan), in the
    /// plan's tier: both from `plans`, an async lookup with its cache
    /// (feature `resolver`). Add the tiers plans name with
    /// [`tier`](Self::tier); the tier is never chosen with
    /// [`choose_tier`](Self::choose_tier) (a [`ConfigError::Tiers`] when
    /// the layer is built). A request whose plan is not found (no lookup
    /// key, an unknown one) has no key for this limit: its
    /// [`MissingKey`](super::MissingKey) policy applies. A failed or slow
    /// lookup gets the resolver's
    /// [`OnLookupError`](crate::layer::OnLookupError) policy: 503 by
    /// default, or no key. The handler of a forwarded request finds the
    /// [`Plan`] among the request's extensions (see [`PlanResolver`]).
    ///
    /// A layer with a resolved rule decides in its response future, never
    /// within `call` (as it does for other layers over a
    /// [`MemoryStore`](crate::MemoryStore)): the lookup is awaited there.
    /// See [`PlanResolver`] for an example.
    #[cfg_attr(docsrs, doc(cfg(feature = "resolver")))]
    pub fn resolved(limit: impl Into<crate::LimitSource>, plans: PlanResolver) -> Self {
        let mut rule = Rule::new(limit, PlanKey(plans.clone(), None));
        rule.plan = Some(plans);
        rule
    }

    /// [`resolved`](Self::resolved), counted per the plan's key named
    /// `key` ([`Plan::with_key`]) instead of its main key, in the plan's
    /// tier: one lookup keys rules by different keys (a tenant's budget
    /// per [`Plan::key`], each of its users per `"user"`). A plan without
    /// a key of that name (or with an empty one) gives the request no key
    /// for this limit: its [`MissingKey`](super::MissingKey) policy
    /// applies. Rules made from clones of one resolver share its lookup,
    /// whichever key they count per.
    ///
    /// ```
    /// use std::time::Duration;
    ///
    /// use axum::{body::Body, routing::get, Router};
    /// use http::{HeaderName, Request, StatusCode};
    /// use tower::ServiceExt;
    /// use tower_ratelimit::key::Header;
    /// use tower_ratelimit::layer::{Plan, PlanResolver, RateLimitLayer, Rule};
    /// use tower_ratelimit::{Limit, Quota};
    ///
    /// # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
    /// // API key -> its organisation, and its user: one lookup
    /// let plans = PlanResolver::builder(Header::new(HeaderName::from_static("x-api-key")), |api_key: Vec<u8>| async move {
    ///     let user = String::from_utf8_lossy(&api_key).into_owned();
    ///     Ok::<_, std::io::Error>(Some(Plan::new("acme").with_key("user", user)))
    /// })
    /// .build()?;
    /// let layer = RateLimitLayer::builder()
    ///     .rule(Rule::resolved(Limit::new("org", Quota::per_hour(3).fixed_window())?, plans.clone()))
    ///     .rule(Rule::resolved_per(Limit::new("user", Quota::per_hour(2).fixed_window())?, plans, "user"))
    ///     .build()?;
    /// let app = Router::new().route("/", get(|| async { "hi" })).layer(layer);
    /// let send = |api_key: &str| {
    ///     let request = Request::get("/").header("x-api-key", api_key).body(Body::empty()).unwrap();
    ///     app.clone().oneshot(request)
    /// };
    /// assert_eq!(send("ann").await?.status(), StatusCode::OK);
    /// assert_eq!(send("ann").await?.status(), StatusCode::OK);
    /// assert_eq!(send("ann").await?.status(), StatusCode::TOO_MANY_REQUESTS); // ann's 2
    /// assert_eq!(send("bob").await?.status(), StatusCode::OK);
    /// assert_eq!(send("bob").await?.status(), StatusCode::TOO_MANY_REQUESTS); // acme's 3
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// # }).unwrap();
    /// ```
    #[cfg_attr(docsrs, doc(cfg(feature = "resolver")))]
    pub fn resolved_per(
        limit: impl Into<crate::LimitSource>,
        plans: PlanResolver,
        key: impl Into<String>,
    ) -> Self {
        let name = key.into().into_boxed_str();
        let mut rule = Rule::new(limit, PlanKey(plans.clone(), Some(name)));
        rule.plan = Some(plans);
        rule
    }
}

/// Before [`Rule::compile`] (in the layer's builder): a resolved rule's
/// tier is its plan's.
pub(crate) fn choose_plan_tiers(rule: &mut Rule) -> Result<(), ConfigError> {
    let Some(plans) = rule.plan.clone() else {
        return Ok(());
    };
    let name = rule.limit.name().to_owned();
    if rule.choose.is_some() {
        return Err(ConfigError::Tiers(format!(
            "limit {name:?} takes its tier from a plan resolver: choose_tier cannot choose it too"
        )));
    }
    if rule.tiers.is_empty() {
        // every request in the limit's own quota, whatever tier plans name
        return Ok(());
    }
    let known: Vec<String> = rule.tiers.iter().map(|(tier, _)| tier.clone()).collect();
    let warned = AtomicBool::new(false);
    rule.choose = Some(Arc::new(tier_choice(move |parts: &Parts| {
        let tier = Resolved::of(parts, &plans)?.tier()?;
        if !known.iter().any(|known| known == tier) && !warned.swap(true, Ordering::Relaxed) {
            tracing::warn!(
                target: "tower_ratelimit",
                limit = %name,
                tier,
                "a plan names a tier limit {name:?} does not have: its requests count in the \
                 default tier (logged once per limit)"
            );
        }
        Some(tier)
    })));
    Ok(())
}

/// A tier choice, its signature spelled out (a closure's own inference
/// does not tie the returned name's lifetime to the request's).
fn tier_choice<F>(choose: F) -> F
where
    F: for<'a> Fn(&'a Parts) -> Option<&'a str>,
{
    choose
}

/// Looks up the plans of `parts`' resolved rules (each resolver once, the
/// rules the request is exempt from left out) and puts them among its
/// extensions, for the rules' keys and tiers, and for the handler (see
/// [`hand_over`]). Each resolver waits at most its timeout, one after the
/// other. A resolver an outer layer already asked for this request is not
/// asked again. A lookup that failed under `OnLookupError::FailClosed` is
/// the 503 returned for the first rule it keys that is not a shadow limit
/// (which never refuses: the request has no key for it).
pub(crate) async fn resolve<B>(
    config: &Config,
    parts: &mut Parts,
) -> Result<(), Response<ResponseBody<B>>> {
    let mut resolved = parts.extensions.remove::<Resolved>().unwrap_or_default();
    for rule in &config.rules {
        let Some(plans) = &rule.plan else { continue };
        if rule.skip.as_ref().is_some_and(|skip| skip(parts)) {
            continue;
        }
        // (a resolver asked already, by an earlier rule or an outer layer,
        // is not asked again)
        let asked = resolved.0.iter().find(|(id, _)| *id == plans.id());
        let failed = match asked {
            Some((_, found)) => found.as_ref().err().copied(),
            None => {
                let found = plans.plan_of(parts).await;
                let failed = found.as_ref().err().copied();
                resolved.0.push((plans.id(), found));
                failed
            }
        };
        if let Some(failed) = failed {
            if !rule.limit().load().is_shadow() {
                let name = rule.limit().name();
                tracing::debug!(target: "tower_ratelimit", limit = name, "a plan lookup failed: 503");
                let why = Rejection::LookupFailed { limit: name };
                let response = || Protocol::of(parts).store_unavailable(failed.retry_after);
                return Err(rejection(config, why, response));
            }
        }
    }
    parts.extensions.insert(resolved);
    Ok(())
}

/// After the limits are chosen: puts the first plan found among the
/// request's extensions as a [`Plan`], for the handler (unless an outer
/// layer put one there). The plans of every resolver stay there too (a
/// private type), for [`PlanResolver::found_in`].
pub(crate) fn hand_over(parts: &mut Parts) {
    if parts.extensions.get::<Plan>().is_some() {
        return;
    }
    let first = parts
        .extensions
        .get::<Resolved>()
        .and_then(|resolved| {
            resolved
                .0
                .iter()
                .find_map(|(_, found)| found.as_ref().ok()?.as_deref())
        })
        .cloned();
    if let Some(plan) = first {
        parts.extensions.insert(plan);
    }
}
