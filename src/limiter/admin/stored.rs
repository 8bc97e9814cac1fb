//! Stored quotas, shared by every instance (see
//! [`Limit::use_stored_quota`]): a limit's, and per key, an override.

use std::time::Duration;

use super::Admin;
use crate::store::{Check, Deadline, Quotas, Quoted};
use crate::{ConfigError, Error, Limit, Quota};

/// The check that names where `own`'s stored quota is: `key`'s override,
/// or (no key) the limit's.
fn stored_check<'a>(own: &'a Limit, key: Option<&'a [u8]>) -> Check<'a> {
    Check {
        limit: own,
        key: key.unwrap_or_default(),
        cost: 0,
    }
}

/// The least time a change of a stored quota is given: on a cluster a
/// limit's quota is copied to every slot (16384 writes).
const STORED_TIMEOUT: Duration = Duration::from_secs(10);

impl Admin<'_> {
    /// This limiter's limit named `name`, if it uses a stored quota (and
    /// `key`, when given, is not empty); with `quota`, also that quota as
    /// the limit (validated, of the limit's algorithm).
    fn stored_limit(
        &self,
        name: &str,
        key: Option<&[u8]>,
        quota: Option<Quota>,
    ) -> Result<(Limit, Option<Limit>), Error> {
        key.map(crate::limiter::non_empty).transpose()?;
        let Some(own) = self
            .limiter
            .limits()
            .into_iter()
            .find(|l| l.name() == name && l.uses_stored_quota())
        else {
            return Err(ConfigError::StoredQuota(format!(
                "the limiter has no limit {name:?} that uses a stored quota \
                 (see Limit::use_stored_quota)"
            ))
            .into());
        };
        let Some(quota) = quota else {
            return Ok((own, None));
        };
        if quota.algorithm() != own.quota().algorithm() {
            return Err(ConfigError::StoredQuota(format!(
                "limit {name:?} uses the {} algorithm, the quota the {}: a stored quota \
                 keeps the limit's algorithm (its state)",
                own.quota().algorithm(),
                quota.algorithm()
            ))
            .into());
        }
        if quota.calendar().is_some() {
            // its code is negative on the wire, where a stored quota's
            // parameters are digits (`Params::from_stored`, `valid_kept`)
            return Err(ConfigError::StoredQuota(format!(
                "limit {name:?}: a calendar quota cannot be a stored quota"
            ))
            .into());
        }
        let mut stored = Limit::new(name, quota)?.use_stored_quota();
        if own.is_shadow() {
            stored = stored.shadow();
        }
        Ok((own, Some(stored)))
    }

    fn stored_deadline(&self) -> Deadline {
        Deadline::after(self.limiter.inner.timeout.max(STORED_TIMEOUT))
    }

    async fn read(&self, name: &str, key: Option<&[u8]>) -> Result<Option<Quota>, Error> {
        let (own, _) = self.stored_limit(name, key, None)?;
        let check = stored_check(&own, key);
        let store = &self.limiter.inner.store;
        let deadline = self.stored_deadline();
        let read = store
            .engine()
            .quotas(&check, key.is_some(), Quotas::Read, deadline);
        match read.get().await? {
            Quoted::Read(quota) => Ok(quota),
            Quoted::Changed(_) => Ok(None),
        }
    }

    async fn write(
        &self,
        name: &str,
        key: Option<&[u8]>,
        quota: Option<Quota>,
        ttl: Option<Duration>,
        if_absent: bool,
    ) -> Result<bool, Error> {
        let (own, stored) = self.stored_limit(name, key, quota)?;
        let change = match &stored {
            Some(limit) => Quotas::Keep {
                limit,
                ttl,
                if_absent,
            },
            None => Quotas::Remove,
        };
        let check = stored_check(&own, key);
        let store = &self.limiter.inner.store;
        let deadline = self.stored_deadline();
        let written = store
            .engine()
            .quotas(&check, key.is_some(), change, deadline);
        match written.get().await? {
            Quoted::Changed(changed) => Ok(changed),
            Quoted::Read(_) => Ok(false),
        }
    }

    /// The stored quota of the limit `limit` (Redisson's
    /// `getConfig`), if any: an equal one (a bucket's rate and period in
    /// lowest terms). See [`Limit::use_stored_quota`].
    pub async fn stored_quota(self, limit: &str) -> Result<Option<Quota>, Error> {
        self.read(limit, None).await
    }

    /// Stores `quota` as the stored quota of the limit `limit` (Redisson's
    /// `setRate`): every instance's next decision of that limit uses it,
    /// for every key without an override. The limit must use a stored
    /// quota ([`Limit::use_stored_quota`]) and `quota` must be valid and
    /// of the limit's algorithm ([`Error::Config`] otherwise). State carries
    /// over as in a rolling deploy.
    ///
    /// In a layer's rule with [tiers](crate::layer::Rule::tier) it is the
    /// default tier's quota: requests of another tier keep their tier's
    /// (a key's [override](Self::set_override) applies in every tier).
    ///
    /// On a cluster the quota is copied to every slot, one write per slot,
    /// so that each decision reads it in its own slot; a change that fails
    /// part way (an error) may leave slots with the old quota: set it
    /// again.
    pub async fn set_stored_quota(self, limit: &str, quota: Quota) -> Result<(), Error> {
        self.write(limit, None, Some(quota), None, false).await?;
        Ok(())
    }

    /// [`set_stored_quota`](Self::set_stored_quota) unless the limit has a
    /// stored quota already (Redisson's `trySetRate`); whether it was set.
    pub async fn set_stored_quota_if_absent(
        self,
        limit: &str,
        quota: Quota,
    ) -> Result<bool, Error> {
        self.write(limit, None, Some(quota), None, true).await
    }

    /// Removes the stored quota of the limit `limit`: its own quota decides
    /// again, state carried over. Whether there was one.
    pub async fn remove_stored_quota(self, limit: &str) -> Result<bool, Error> {
        self.write(limit, None, None, None, false).await
    }

    /// Gives `key` its own quota in the limit `limit` (one customer, one
    /// phone number), for `ttl` when given: it takes precedence over the
    /// limit's stored and own quotas for that key only, in every instance's
    /// next decision. Same conditions as
    /// [`set_stored_quota`](Self::set_stored_quota). Kept beside the key's
    /// state (one slot on a cluster); [`reset`](crate::Limiter::reset) leaves it.
    ///
    /// In a layer's rule with [tiers](crate::layer::Rule::tier) it decides
    /// the key's requests whatever their tier: an override is about the
    /// customer, so it wins over the plan. Requests without a key that a
    /// rule counts under its shared key
    /// ([`MissingKey::Shared`](crate::layer::MissingKey::Shared)) are kept
    /// apart from every real key, the one of that name too: neither an
    /// override nor the stored quota applies to them. A cost charged after
    /// the response is bounded by the override's capacity; the most one
    /// estimate may ask ([`Rule::settle_estimates`](crate::layer::Rule::settle_estimates))
    /// is a share of the tier's own capacity, known before the store is
    /// asked.
    pub async fn set_override(
        self,
        limit: &str,
        key: impl AsRef<[u8]>,
        quota: Quota,
        ttl: Option<Duration>,
    ) -> Result<(), Error> {
        let key = Some(key.as_ref());
        self.write(limit, key, Some(quota), ttl, false).await?;
        Ok(())
    }

    /// `key`'s override in the limit `limit`, if one is in force.
    pub async fn stored_override(
        self,
        limit: &str,
        key: impl AsRef<[u8]>,
    ) -> Result<Option<Quota>, Error> {
        self.read(limit, Some(key.as_ref())).await
    }

    /// Removes `key`'s override in the limit `limit`: the key returns to the
    /// limit's quota, its state carried over. Whether one was in force.
    pub async fn remove_override(self, limit: &str, key: impl AsRef<[u8]>) -> Result<bool, Error> {
        self.write(limit, Some(key.as_ref()), None, None, false)
            .await
    }
}
