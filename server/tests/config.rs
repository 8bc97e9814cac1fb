//! The configuration: envoyproxy/ratelimit's parser cases re-expressed
//! (their YAML, their lookups, their error messages), its integration
//! runtime files, the opt-in `tower_ratelimit` extension, and the live
//! reload of the runtime folder.
//!
//! envoyproxy/ratelimit's test/config/config_test.go, case by case:
//!
//! Re-expressed (fixtures under tests/config/ rewritten with the same
//! descriptors; the inline Go structs as inline YAML):
//! - TestBasicConfig: every lookup and its stats key (`basic_config`).
//! - TestDomainMerge (`domain_merge`).
//! - TestEmptyDomain, TestDuplicateDomain, TestEmptyKey, TestDuplicateKey,
//!   TestDuplicateKeyDomainMerge, TestBadLimitUnit, TestReplacesSelf,
//!   TestReplacesEmpty, TestMisspelledKey (both files), TestNonStringKey,
//!   TestNonMapList, TestUnlimitedWithRateLimitUnit: their messages word
//!   for word, with the file's name (`errors_*`).
//! - TestBadYaml: the file is refused with the same prefix
//!   (`bad_yaml.yaml: error loading config file: yaml: line ...`); the rest
//!   of the sentence is the YAML parser's own (Go's yaml.v2 says "found
//!   unexpected end of stream", saphyr says where the quote is unclosed).
//! - TestShadowModeConfig (`shadow_mode`).
//! - TestWildcardConfig (`wildcards`).
//! - TestDetailedMetric: all seven table cases (`detailed_metric_*`).
//! - TestValueToMetric_UsesRuntimeValuesInStats, _DefaultKeyIncludesValueAtThatLevel,
//!   _MidLevelOnly, _NoFlag_Unchanged, _DoesNotOverrideDetailedMetric,
//!   _WithConfiguredValues, _WithWildcard, _WithEmptyValue,
//!   _FullKeyMatchesStatsKey (`value_to_metric_*`).
//! - TestShareThreshold: its eight sub-cases (`share_threshold_*`), with the
//!   counter key (their base_limiter's cache key) checked too.
//! - TestWildcardStatsBehavior: its seven sub-cases (`wildcard_stats_*`).
//! - TestMetadata (`metadata`).
//!
//! Left out:
//! - TestConfigLimitOverride: a request's `limit` override is decided by
//!   the service (tests/service.rs), not by the configuration's lookup.
//! - The `domain_not_found` counter of TestBasicConfig: the service counts
//!   it; here `has_domain` / a `None` lookup are checked.
//! - The Go tests' counter increments (`rl.Stats.TotalHits.Inc()`): stats
//!   belong to the service; here the stats key they are counted under is
//!   checked, which is what those assertions establish.
//!
//! Also: test/integration/runtime/current/ratelimit/{config/*.yaml,reload.yaml}
//! load (rewritten under tests/config/integration/); config_impl.go's
//! share_threshold-without-wildcard check; yaml.v2's typed errors (and
//! that the whole file's types are read before the checks, as Go decodes
//! it whole first); what this server adds: duplicate YAML keys refused,
//! nesting bounded, the dump, every rule's crate limit (its windows reset
//! where envoyproxy's reset, second to year, decided on the memory store;
//! names distinct), the extension's cases and errors; and the runtime
//! folder read as goruntime names its files and followed live: a
//! ConfigMap's `..data` swap and a `RUNTIME_ROOT` symlink swap with
//! RUNTIME_WATCH_ROOT=true, plain rewrites, new and removed files and a
//! folder made again with RUNTIME_WATCH_ROOT=false, a bad set keeping the
//! configuration in force (and counted), each seen within a bounded wait.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tower_ratelimit::{Algorithm as CrateAlgorithm, Period};
use tower_ratelimit_server::config::{
    Algorithm, ConfigError, Matched, RateLimitConfig, Rule, Unit,
};
use tower_ratelimit_server::runtime::{read_files, Runtime, RuntimeSettings};

fn fixture(name: &str) -> (String, String) {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/config")
        .join(name);
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("fixture {}: {e}", path.display()));
    (name.rsplit('/').next().unwrap_or(name).to_string(), text)
}

fn load(names: &[&str], merge: bool) -> Result<RateLimitConfig, ConfigError> {
    let files: Vec<_> = names.iter().map(|n| fixture(n)).collect();
    RateLimitConfig::from_files(&files, merge)
}

fn config(name: &str) -> RateLimitConfig {
    load(&[name], false).unwrap_or_else(|e| panic!("{e}"))
}

fn inline(yaml: &str) -> RateLimitConfig {
    RateLimitConfig::from_files(&[("inline".to_string(), yaml.to_string())], false)
        .unwrap_or_else(|e| panic!("{e}"))
}

fn inline_err(yaml: &str) -> String {
    match RateLimitConfig::from_files(&[("inline.yaml".to_string(), yaml.to_string())], false) {
        Ok(_) => panic!("loaded, but should be refused:\n{yaml}"),
        Err(e) => e.to_string(),
    }
}

fn get(c: &RateLimitConfig, domain: &str, entries: &[(&str, &str)]) -> Option<Matched> {
    c.get_limit(domain, entries)
}

/// The match, which must exist.
fn hit(c: &RateLimitConfig, domain: &str, entries: &[(&str, &str)]) -> Matched {
    get(c, domain, entries).unwrap_or_else(|| panic!("no limit for {entries:?}"))
}

fn rpu_unit(m: &Matched) -> (u32, Option<Unit>) {
    (m.rule.requests_per_unit, m.rule.unit)
}

fn error_of(names: &[&str], merge: bool) -> String {
    match load(names, merge) {
        Ok(_) => panic!("{names:?} loaded, but should be refused"),
        Err(e) => e.to_string(),
    }
}

// ---------------------------------------------------------------- basic

#[test]
fn basic_config() {
    let c = config("basic_config.yaml");
    assert!(!c.is_empty());
    assert!(!c.has_domain("foo_domain"));
    assert!(c.has_domain("test-domain"));
    assert!(get(&c, "foo_domain", &[]).is_none());
    assert!(get(&c, "test-domain", &[]).is_none());
    // No limit: key1 alone, key1 with another value, a deeper request than
    // the config, a value the config has no entry for.
    for entries in [
        &[("key1", "something")][..],
        &[("key1", "value1")],
        &[("key2", "value2"), ("subkey", "subvalue")],
        &[("key5", "value5"), ("subkey5", "subvalue")],
        &[("key2", "value3")],
    ] {
        assert!(get(&c, "test-domain", entries).is_none(), "{entries:?}");
    }

    let m = hit(
        &c,
        "test-domain",
        &[("key1", "value1"), ("subkey1", "something")],
    );
    assert_eq!(rpu_unit(&m), (5, Some(Unit::Second)));
    assert_eq!(m.stats_key, "test-domain.key1_value1.subkey1");
    assert_eq!(m.rule.full_key, "test-domain.key1_value1.subkey1");

    let m = hit(
        &c,
        "test-domain",
        &[("key1", "value1"), ("subkey1", "subvalue1")],
    );
    assert_eq!(rpu_unit(&m), (10, Some(Unit::Second)));
    assert_eq!(m.stats_key, "test-domain.key1_value1.subkey1_subvalue1");

    let m = hit(&c, "test-domain", &[("key2", "something")]);
    assert_eq!(rpu_unit(&m), (20, Some(Unit::Minute)));
    assert_eq!(m.stats_key, "test-domain.key2");

    let m = hit(&c, "test-domain", &[("key2", "value2")]);
    assert_eq!(rpu_unit(&m), (30, Some(Unit::Minute)));
    assert_eq!(m.stats_key, "test-domain.key2_value2");

    let m = hit(&c, "test-domain", &[("key3", "foo")]);
    assert_eq!(rpu_unit(&m), (1, Some(Unit::Hour)));
    assert_eq!(m.rule.name, None, "no name in the config");
    assert_eq!(m.stats_key, "test-domain.key3");

    let m = hit(&c, "test-domain", &[("key4", "foo")]);
    assert_eq!(rpu_unit(&m), (1, Some(Unit::Day)));
    assert_eq!(m.rule.name.as_deref(), Some("key4_rate_limit"));
    assert_eq!(m.stats_key, "test-domain.key4");

    let m = hit(&c, "test-domain", &[("key6", "foo")]);
    assert!(m.rule.unlimited);
    assert!(
        m.rule.limit.is_none(),
        "an unlimited rule has no crate limit"
    );
    assert_eq!(m.stats_key, "test-domain.key6");

    // detailed_metric: the value joins the stats key.
    for value in ["unspecified_value", "another_value"] {
        let m = hit(&c, "test-domain", &[("key7", value)]);
        assert_eq!(rpu_unit(&m), (70, Some(Unit::Minute)));
        assert_eq!(m.stats_key, format!("test-domain.key7_{value}"));
        assert_eq!(m.rule.full_key, "test-domain.key7");
    }
    // The counter key's descriptor part: every entry's key and value.
    let m = hit(
        &c,
        "test-domain",
        &[("key1", "value1"), ("subkey1", "something")],
    );
    assert_eq!(m.counter_key, "key1_value1_subkey1_something");
    assert!(!m.tower);
}

#[test]
fn domain_merge() {
    let c = load(&["merge_domain_key1.yaml", "merge_domain_key2.yaml"], true).unwrap();
    assert!(get(&c, "foo_domain", &[]).is_none());
    assert!(get(&c, "test-domain", &[]).is_none());
    assert_eq!(
        hit(&c, "test-domain", &[("key1", "value1")])
            .rule
            .requests_per_unit,
        10
    );
    assert_eq!(
        hit(&c, "test-domain", &[("key2", "value2")])
            .rule
            .requests_per_unit,
        20
    );
    // Without MERGE_DOMAIN_CONFIG the second file is refused.
    assert_eq!(
        error_of(&["merge_domain_key1.yaml", "merge_domain_key2.yaml"], false),
        "merge_domain_key2.yaml: duplicate domain 'test-domain' in config file"
    );
}

// ---------------------------------------------------------------- errors

#[test]
fn errors_empty_domain() {
    assert_eq!(
        error_of(&["empty_domain.yaml"], false),
        "empty_domain.yaml: config file cannot have empty domain"
    );
}

#[test]
fn errors_duplicate_domain() {
    assert_eq!(
        error_of(&["basic_config.yaml", "duplicate_domain.yaml"], false),
        "duplicate_domain.yaml: duplicate domain 'test-domain' in config file"
    );
}

#[test]
fn errors_empty_key() {
    assert_eq!(
        error_of(&["empty_key.yaml"], false),
        "empty_key.yaml: descriptor has empty key"
    );
}

#[test]
fn errors_duplicate_key() {
    assert_eq!(
        error_of(&["duplicate_key.yaml"], false),
        "duplicate_key.yaml: duplicate descriptor composite key 'test-domain.key1_value1'"
    );
}

#[test]
fn errors_duplicate_key_domain_merge() {
    assert_eq!(
        error_of(&["merge_domain_key1.yaml", "merge_domain_key1.yaml"], true),
        "merge_domain_key1.yaml: duplicate descriptor composite key 'test-domain.key1_value1'"
    );
}

#[test]
fn errors_bad_limit_unit() {
    assert_eq!(
        error_of(&["bad_limit_unit.yaml"], false),
        "bad_limit_unit.yaml: invalid rate limit unit 'foo'"
    );
}

#[test]
fn errors_replaces_self() {
    assert_eq!(
        error_of(&["replaces_self.yaml"], false),
        "replaces_self.yaml: replaces should not contain name of same descriptor"
    );
}

#[test]
fn errors_replaces_empty() {
    assert_eq!(
        error_of(&["replaces_empty.yaml"], false),
        "replaces_empty.yaml: should not have an empty replaces entry"
    );
}

#[test]
fn errors_bad_yaml() {
    let e = error_of(&["bad_yaml.yaml"], false);
    assert!(
        e.starts_with("bad_yaml.yaml: error loading config file: yaml: line "),
        "{e}"
    );
}

#[test]
fn errors_misspelled_key() {
    assert_eq!(
        error_of(&["misspelled_key.yaml"], false),
        "misspelled_key.yaml: config error, unknown key 'ratelimit'"
    );
    assert_eq!(
        error_of(&["misspelled_key2.yaml"], false),
        "misspelled_key2.yaml: config error, unknown key 'requestsperunit'"
    );
}

#[test]
fn errors_non_string_key() {
    assert_eq!(
        error_of(&["non_string_key.yaml"], false),
        "non_string_key.yaml: config error, key is not of type string: 0.25"
    );
}

#[test]
fn errors_non_map_list() {
    assert_eq!(
        error_of(&["non_map_list.yaml"], false),
        "non_map_list.yaml: config error, yaml file contains list of type other than map: a"
    );
}

#[test]
fn errors_unlimited_with_unit() {
    assert_eq!(
        error_of(&["unlimited_with_unit.yaml"], false),
        "unlimited_with_unit.yaml: should not specify rate limit unit when unlimited"
    );
}

#[test]
fn errors_share_threshold_without_wildcard() {
    // config_impl.go's check (no Go test file for it).
    let e = inline_err(
        "domain: d\ndescriptors:\n  - key: k\n    value: v\n    share_threshold: true\n",
    );
    assert_eq!(
        e,
        "inline.yaml: share_threshold can only be used with wildcard values (containing '*'), \
         but found key 'k_v'"
    );
}

#[test]
fn errors_beyond_envoyproxy() {
    // A key written twice in one mapping (yaml.v2 kept the last silently).
    let e = inline_err("domain: d\ndescriptors:\n  - key: a\n    key: b\n");
    assert!(e.starts_with("inline.yaml: error loading config file: yaml: line 4: key 'key' already defined at line 3"), "{e}");
    let e = inline_err("domain: d\ndomain: e\n");
    assert!(e.contains("key 'domain' already defined"), "{e}");
    // Values of the wrong type, with yaml.v2's words.
    let e = inline_err("domain: d\ndescriptors:\n  - key: a\n    rate_limit:\n      unit: second\n      requests_per_unit: lots\n");
    assert_eq!(e, "inline.yaml: error loading config file: yaml: unmarshal errors:\n  line 6: cannot unmarshal !!str `lots` into uint32");
    let e = inline_err("domain: d\ndescriptors:\n  - key: a\n    rate_limit:\n      unit: second\n      requests_per_unit: -1\n");
    assert!(
        e.ends_with("cannot unmarshal !!int `-1` into uint32"),
        "{e}"
    );
    let e = inline_err("domain: d\ndescriptors: many\n");
    assert!(
        e.ends_with("line 2: cannot unmarshal !!str `many` into []config.YamlDescriptor"),
        "{e}"
    );
    let e = inline_err("domain: d\ndescriptors:\n  - key: a\n    shadow_mode: maybe\n");
    assert!(
        e.ends_with("cannot unmarshal !!str `maybe` into bool"),
        "{e}"
    );
    // Types are read for the whole file before the checks, as Go decodes it
    // whole first: the bad type of the second descriptor is reported, not
    // the empty key of the first.
    let e =
        inline_err("domain: d\ndescriptors:\n  - value: v\n  - key: b\n    quota_mode: \"yes\"\n");
    assert!(
        e.ends_with("line 5: cannot unmarshal !!str `yes` into bool"),
        "{e}"
    );
    // A float anywhere: validateYamlKeys' catch-all.
    let e = inline_err("domain: d\ndescriptors:\n  - key: a\n    rate_limit:\n      unit: second\n      requests_per_unit: 1.5\n");
    assert_eq!(e, "inline.yaml: error checking config");
    // A document that is not a mapping.
    let e = inline_err("- a\n- b\n");
    assert!(
        e.ends_with("cannot unmarshal !!seq into map[interface {}]interface {}"),
        "{e}"
    );
    // Nesting beyond reason is refused, not a stack overflow.
    let deep = format!("domain: d\nx: {}{}\n", "[".repeat(500), "]".repeat(500));
    let e = inline_err(&deep);
    assert!(
        e.starts_with("inline.yaml: error loading config file: yaml: line 2: "),
        "{e}"
    );
    let deep = format!("domain: d\nx: {}{}\n", "[".repeat(70), "]".repeat(70));
    let e = inline_err(&deep);
    assert!(e.contains("line 2: nested deeper than 64 levels"), "{e}");
    // Not UTF-8: refused with the file's name by the runtime reader (below).
}

#[test]
fn scalars_read_as_yaml_v2_reads_them() {
    // A string field takes any scalar's text; units are case-insensitive;
    // yes/on are booleans; a null rate_limit is none; an empty file is an
    // empty domain.
    let c = inline(
        "domain: 7\ndescriptors:\n  - key: 200\n    value: true\n    shadow_mode: yes\n    rate_limit:\n      unit: MINUTE\n      requests_per_unit: 0x10\n  - key: none\n    rate_limit:\n",
    );
    let m = hit(&c, "7", &[("200", "true")]);
    assert_eq!(rpu_unit(&m), (16, Some(Unit::Minute)));
    assert!(m.rule.shadow_mode);
    assert!(get(&c, "7", &[("none", "x")]).is_none());
    assert_eq!(
        inline_err(""),
        "inline.yaml: config file cannot have empty domain"
    );
    // Anchors and aliases work.
    let c = inline("domain: d\ndescriptors:\n  - key: a\n    rate_limit: &l {unit: hour, requests_per_unit: 3}\n  - key: b\n    rate_limit: *l\n");
    assert_eq!(
        rpu_unit(&hit(&c, "d", &[("b", "x")])),
        (3, Some(Unit::Hour))
    );
    // A misplaced but known key is ignored, as yaml.v2's typed decode does.
    let c = inline("domain: d\nunit: second\ndescriptors:\n  - key: a\n    requests_per_unit: 4\n");
    assert!(get(&c, "d", &[("a", "x")]).is_none());
}

// ---------------------------------------------------------------- shadow

#[test]
fn shadow_mode() {
    let c = config("shadowmode_config.yaml");
    let m = hit(
        &c,
        "test-domain",
        &[("key1", "value1"), ("subkey1", "something")],
    );
    assert!(!m.rule.shadow_mode);
    assert_eq!(rpu_unit(&m), (5, Some(Unit::Second)));
    assert_eq!(m.stats_key, "test-domain.key1_value1.subkey1");

    let m = hit(
        &c,
        "test-domain",
        &[("key1", "value1"), ("subkey1", "subvalue1")],
    );
    assert!(m.rule.shadow_mode);
    assert_eq!(rpu_unit(&m), (10, Some(Unit::Second)));
    assert_eq!(m.stats_key, "test-domain.key1_value1.subkey1_subvalue1");

    let m = hit(&c, "test-domain", &[("key2", "something")]);
    assert!(m.rule.shadow_mode);
    assert_eq!(rpu_unit(&m), (20, Some(Unit::Minute)));
    assert_eq!(m.stats_key, "test-domain.key2");

    let m = hit(&c, "test-domain", &[("key2", "value2")]);
    assert!(!m.rule.shadow_mode);
    assert_eq!(rpu_unit(&m), (30, Some(Unit::Minute)));
    assert_eq!(m.stats_key, "test-domain.key2_value2");
}

// ---------------------------------------------------------------- wildcards

#[test]
fn wildcards() {
    let c = config("wildcard.yaml");
    // No value matches any value, under the key alone.
    let a = hit(&c, "test-domain", &[("noVal", "foo1")]);
    let b = hit(&c, "test-domain", &[("noVal", "foo2")]);
    assert!(Arc::ptr_eq(&a.rule, &b.rule));
    assert_eq!(a.stats_key, "test-domain.noVal");
    assert_eq!(a.stats_key, a.rule.full_key);
    assert_eq!(a.stats_key, b.stats_key);

    // A trailing wildcard: one rule, stats under the pattern.
    let w1 = hit(&c, "test-domain", &[("wild", "foo1")]);
    let w2 = hit(&c, "test-domain", &[("wild", "foo2")]);
    let w3 = hit(
        &c,
        "test-domain",
        &[("nestedWild", "val1"), ("wild", "goo2")],
    );
    assert!(Arc::ptr_eq(&w1.rule, &w2.rule));
    assert_eq!(w1.stats_key, "test-domain.wild_foo*");
    assert_eq!(w1.rule.full_key, "test-domain.wild_foo*");
    assert_eq!(w2.stats_key, "test-domain.wild_foo*");
    assert_eq!(w3.stats_key, "test-domain.nestedWild_val1.wild_goo*");
    assert_eq!(w3.rule.full_key, "test-domain.nestedWild_val1.wild_goo*");
    // Without share_threshold each value counts apart.
    assert_eq!(w1.counter_key, "wild_foo1");
    assert_eq!(w2.counter_key, "wild_foo2");

    assert!(get(&c, "test-domain", &[("wild", "bar")]).is_none());
    assert!(
        get(&c, "test-domain", &[("noWild", "foo1")]).is_none(),
        "no eager match"
    );

    // A wildcard in the middle (`bar*b`), the empty run included.
    let m1 = hit(&c, "test-domain", &[("midWild", "barab")]);
    let m2 = hit(&c, "test-domain", &[("midWild", "bar123b")]);
    assert!(Arc::ptr_eq(&m1.rule, &m2.rule));
    assert_eq!(m1.stats_key, "test-domain.midWild_bar*b");
    assert_eq!(m1.rule.full_key, "test-domain.midWild_bar*b");
    assert!(get(&c, "test-domain", &[("midWild", "barb")]).is_some());
    assert!(get(&c, "test-domain", &[("midWild", "bara")]).is_none());
    assert!(get(&c, "test-domain", &[("midWild", "xbarb")]).is_none());

    // Several wildcards (`foo*bar*baz`), in order.
    let x1 = hit(&c, "test-domain", &[("multiWild", "foo123bar456baz")]);
    let x2 = hit(&c, "test-domain", &[("multiWild", "foobarbaz")]);
    assert!(Arc::ptr_eq(&x1.rule, &x2.rule));
    assert_eq!(x1.stats_key, "test-domain.multiWild_foo*bar*baz");
    assert_eq!(x1.rule.requests_per_unit, 10);
    assert!(get(&c, "test-domain", &[("multiWild", "foo123baz")]).is_none());
    assert!(get(&c, "test-domain", &[("multiWild", "bar456baz")]).is_none());
}

// ---------------------------------------------------------------- detailed_metric

const NESTED_REALISTIC: &str = "
domain: nested
descriptors:
  - key: key_1
    detailed_metric: true
    rate_limit: {unit: minute, requests_per_unit: 500}
  - key: key_1
    value: some-value-for-key-1
    rate_limit: {unit: minute, requests_per_unit: 500}
  - key: key_2
    detailed_metric: true
    rate_limit: {unit: minute, requests_per_unit: 5000}
    descriptors:
      - key: key_3
        detailed_metric: true
      - key: key_3
        value: requested-key3-value
        detailed_metric: true
        rate_limit: {unit: minute, requests_per_unit: 5}
  - key: key_2
    value: specific-id
    detailed_metric: true
    rate_limit: {unit: minute, requests_per_unit: 50000}
    descriptors:
      - key: key_3
        detailed_metric: true
      - key: key_3
        value: requested-key3-value
        detailed_metric: true
        rate_limit: {unit: minute, requests_per_unit: 100}
";

fn two_levels(outer_detailed: bool, inner_detailed: bool) -> String {
    format!(
        "domain: nested
descriptors:
  - key: key-1
    detailed_metric: {outer_detailed}
    rate_limit: {{unit: minute, requests_per_unit: 100}}
    descriptors:
      - key: key-2
        detailed_metric: {inner_detailed}
        rate_limit: {{unit: minute, requests_per_unit: 5}}
"
    )
}

#[test]
fn detailed_metric_top_level_request() {
    let c = inline(&two_levels(true, false));
    assert_eq!(
        hit(&c, "nested", &[("key-1", "value-1")]).stats_key,
        "nested.key-1_value-1"
    );
}

#[test]
fn detailed_metric_top_level_request_without_detail() {
    let c = inline(&two_levels(false, false));
    assert_eq!(
        hit(&c, "nested", &[("key-1", "value-1")]).stats_key,
        "nested.key-1"
    );
}

#[test]
fn detailed_metric_nested_request() {
    let c = inline(&two_levels(true, true));
    let m = hit(&c, "nested", &[("key-1", "value-1"), ("key-2", "value-2")]);
    assert_eq!(m.stats_key, "nested.key-1_value-1.key-2_value-2");
}

#[test]
fn detailed_metric_nested_request_without_detail() {
    let c = inline(&two_levels(false, false));
    let m = hit(&c, "nested", &[("key-1", "value-1"), ("key-2", "value-2")]);
    assert_eq!(m.stats_key, "nested.key-1.key-2");
}

#[test]
fn detailed_metric_realistic_config() {
    let c = RateLimitConfig::from_files(&[("n".into(), NESTED_REALISTIC.into())], true).unwrap();
    assert_eq!(
        hit(&c, "nested", &[("key_1", "value-for-key-1")]).stats_key,
        "nested.key_1_value-for-key-1"
    );
    assert_eq!(
        hit(&c, "nested", &[("key_2", "key-2-value")]).stats_key,
        "nested.key_2_key-2-value"
    );
    assert_eq!(
        hit(
            &c,
            "nested",
            &[("key_2", "key-2-value"), ("key_3", "requested-key3-value")]
        )
        .stats_key,
        "nested.key_2_key-2-value.key_3_requested-key3-value"
    );
}

// ---------------------------------------------------------------- value_to_metric

const ROUTE_METHOD_SUBJECT: &str = "
domain: domain
descriptors:
  - key: route
    value_to_metric: true
    descriptors:
      - key: http_method
        value_to_metric: true
        descriptors:
          - key: subject_id
            rate_limit: {unit: minute, requests_per_unit: 60}
";

#[test]
fn value_to_metric_uses_runtime_values() {
    let c = inline(ROUTE_METHOD_SUBJECT);
    let m = hit(
        &c,
        "domain",
        &[
            ("route", "draw"),
            ("http_method", "GET"),
            ("subject_id", "123"),
        ],
    );
    assert_eq!(m.stats_key, "domain.route_draw.http_method_GET.subject_id");
}

#[test]
fn value_to_metric_default_key_includes_value_at_that_level() {
    let c = inline("domain: d\ndescriptors:\n  - key: k1\n    value_to_metric: true\n    descriptors:\n      - key: k2\n        rate_limit: {unit: second, requests_per_unit: 1}\n");
    assert_eq!(
        hit(&c, "d", &[("k1", "A"), ("k2", "foo")]).stats_key,
        "d.k1_A.k2"
    );
}

#[test]
fn value_to_metric_mid_level_only() {
    let c = inline("domain: d\ndescriptors:\n  - key: k1\n    descriptors:\n      - key: k2\n        value_to_metric: true\n        descriptors:\n          - key: k3\n            rate_limit: {unit: second, requests_per_unit: 1}\n");
    assert_eq!(
        hit(&c, "d", &[("k1", "X"), ("k2", "Y"), ("k3", "Z")]).stats_key,
        "d.k1.k2_Y.k3"
    );
}

#[test]
fn value_to_metric_no_flag_unchanged() {
    let c = inline("domain: d\ndescriptors:\n  - key: k1\n    descriptors:\n      - key: k2\n        rate_limit: {unit: second, requests_per_unit: 1}\n");
    assert_eq!(
        hit(&c, "d", &[("k1", "X"), ("k2", "Y")]).stats_key,
        "d.k1.k2"
    );
}

#[test]
fn value_to_metric_does_not_override_detailed_metric() {
    let yaml = ROUTE_METHOD_SUBJECT.replace(
        "          - key: subject_id\n",
        "          - key: subject_id\n            detailed_metric: true\n",
    );
    let c = inline(&yaml);
    let m = hit(
        &c,
        "domain",
        &[
            ("route", "draw"),
            ("http_method", "GET"),
            ("subject_id", "123"),
        ],
    );
    assert_eq!(
        m.stats_key,
        "domain.route_draw.http_method_GET.subject_id_123"
    );
}

#[test]
fn value_to_metric_with_configured_values() {
    let c = inline(
        "
domain: test-domain
descriptors:
  - key: route
    value_to_metric: true
    descriptors:
      - key: http_method
        value: GET
        value_to_metric: true
        descriptors:
          - key: subject_id
            rate_limit: {unit: minute, requests_per_unit: 60}
      - key: http_method
        value: POST
        value_to_metric: true
        descriptors:
          - key: subject_id
            rate_limit: {unit: minute, requests_per_unit: 30}
",
    );
    let m = hit(
        &c,
        "test-domain",
        &[
            ("route", "api"),
            ("http_method", "GET"),
            ("subject_id", "user123"),
        ],
    );
    assert_eq!(m.rule.requests_per_unit, 60);
    assert_eq!(
        m.stats_key,
        "test-domain.route_api.http_method_GET.subject_id"
    );
    let m = hit(
        &c,
        "test-domain",
        &[
            ("route", "api"),
            ("http_method", "POST"),
            ("subject_id", "user456"),
        ],
    );
    assert_eq!(m.rule.requests_per_unit, 30);
    assert_eq!(
        m.stats_key,
        "test-domain.route_api.http_method_POST.subject_id"
    );
}

#[test]
fn value_to_metric_with_wildcard() {
    let c = inline(
        "
domain: domain
descriptors:
  - key: user
    value_to_metric: true
    descriptors:
      - key: action
        value: read*
        value_to_metric: true
        descriptors:
          - key: resource
            rate_limit: {unit: minute, requests_per_unit: 100}
",
    );
    let m = hit(
        &c,
        "domain",
        &[
            ("user", "alice"),
            ("action", "readfile"),
            ("resource", "documents"),
        ],
    );
    assert_eq!(m.rule.requests_per_unit, 100);
    assert_eq!(m.stats_key, "domain.user_alice.action_readfile.resource");
    let m = hit(
        &c,
        "domain",
        &[
            ("user", "bob"),
            ("action", "readdata"),
            ("resource", "database"),
        ],
    );
    assert_eq!(m.stats_key, "domain.user_bob.action_readdata.resource");
}

#[test]
fn value_to_metric_with_empty_value() {
    let c = inline(ROUTE_METHOD_SUBJECT);
    let key = |route, method| {
        hit(
            &c,
            "domain",
            &[
                ("route", route),
                ("http_method", method),
                ("subject_id", "123"),
            ],
        )
        .stats_key
    };
    assert_eq!(key("", "GET"), "domain.route.http_method_GET.subject_id");
    assert_eq!(key("draw", ""), "domain.route_draw.http_method.subject_id");
    assert_eq!(key("", ""), "domain.route.http_method.subject_id");
}

#[test]
fn value_to_metric_full_key_and_stats_key() {
    // The stats key is what their FullKey is set to after the lookup; the
    // rule's own full_key stays the config path.
    let c = inline(&ROUTE_METHOD_SUBJECT.replace("domain: domain", "domain: test-domain"));
    let m = hit(
        &c,
        "test-domain",
        &[
            ("route", "api"),
            ("http_method", "GET"),
            ("subject_id", "user123"),
        ],
    );
    assert_eq!(
        m.stats_key,
        "test-domain.route_api.http_method_GET.subject_id"
    );
    assert_eq!(m.rule.full_key, "test-domain.route.http_method.subject_id");

    let plain = "domain: test-domain-2\ndescriptors:\n  - key: route\n    descriptors:\n      - key: http_method\n        descriptors:\n          - key: subject_id\n            rate_limit: {unit: minute, requests_per_unit: 60}\n";
    let c = inline(plain);
    let m = hit(
        &c,
        "test-domain-2",
        &[
            ("route", "api"),
            ("http_method", "GET"),
            ("subject_id", "user123"),
        ],
    );
    assert_eq!(m.stats_key, m.rule.full_key);

    let detailed = plain.replace("test-domain-2", "test-domain-3").replace(
        "          - key: subject_id\n",
        "          - key: subject_id\n            detailed_metric: true\n",
    );
    let c = inline(&detailed);
    let m = hit(
        &c,
        "test-domain-3",
        &[
            ("route", "api"),
            ("http_method", "GET"),
            ("subject_id", "user123"),
        ],
    );
    assert_eq!(
        m.stats_key,
        "test-domain-3.route_api.http_method_GET.subject_id_user123"
    );
}

// ---------------------------------------------------------------- share_threshold

#[test]
fn share_threshold_basic() {
    let c = config("share_threshold.yaml");
    for value in ["files/a.pdf", "files/b.csv", "files/c.txt"] {
        let m = hit(&c, "test-domain", &[("files", value)]);
        assert_eq!(m.rule.requests_per_unit, 100);
        assert_eq!(m.stats_key, "test-domain.files_files/*");
        // One counter for every value: the pattern stands for the value.
        assert_eq!(m.counter_key, "files_files/*");
    }
}

#[test]
fn share_threshold_with_metrics() {
    let c = config("share_threshold.yaml");
    let m = hit(&c, "test-domain", &[("route", "api/v1"), ("method", "GET")]);
    assert_eq!(m.stats_key, "test-domain.route_api/*.method");
    assert_eq!(m.counter_key, "route_api/*_method_GET");
    let m = hit(
        &c,
        "test-domain",
        &[("service", "svc/user"), ("endpoint", "get")],
    );
    assert!(m.rule.detailed_metric);
    assert_eq!(m.stats_key, "test-domain.service_svc/*.endpoint_get");
    assert_eq!(m.counter_key, "service_svc/*_endpoint_get");
}

#[test]
fn share_threshold_nested_wildcards() {
    let c = config("share_threshold.yaml");
    let m = hit(
        &c,
        "test-domain",
        &[("nested", "parent"), ("files", "nested/file1.txt")],
    );
    assert_eq!(m.rule.requests_per_unit, 200);
    assert_eq!(m.stats_key, "test-domain.nested_parent.files_nested/*");
    assert_eq!(m.counter_key, "nested_parent_files_nested/*");

    let m = hit(
        &c,
        "test-domain",
        &[("files", "top/file1.txt"), ("files", "nested/file1.txt")],
    );
    assert_eq!(m.rule.requests_per_unit, 300);
    assert_eq!(m.stats_key, "test-domain.files_top/*.files_nested/*");
    assert_eq!(m.counter_key, "files_top/*_files_nested/*");

    // The parent shares, the child (a wildcard without share_threshold)
    // counts each value but shows its pattern in the stats.
    let m = hit(
        &c,
        "test-domain",
        &[("path", "path/foo"), ("file", "file/doc1"), ("type", "pdf")],
    );
    assert_eq!(m.stats_key, "test-domain.path_path/*.file_file/*.type");
    assert_eq!(m.counter_key, "path_path/*_file_file/doc1_type_pdf");

    let m = hit(
        &c,
        "test-domain",
        &[
            ("user", "user/alice"),
            ("resource", "res/file1"),
            ("action", "read"),
        ],
    );
    assert_eq!(m.stats_key, "test-domain.user_user/*.resource_res/*.action");
    assert_eq!(m.counter_key, "user_user/*_resource_res/*_action_read");
}

#[test]
fn share_threshold_explicit_value_first() {
    let c = config("share_threshold.yaml");
    let m = hit(&c, "test-domain", &[("file", "test1")]);
    assert_eq!(m.rule.requests_per_unit, 50);
    assert_eq!(m.stats_key, "test-domain.file_test1");
    assert_eq!(m.counter_key, "file_test1");
    for value in ["test2", "test23", "test123"] {
        let m = hit(&c, "test-domain", &[("file", value)]);
        assert_eq!(m.rule.requests_per_unit, 100);
        assert_eq!(m.stats_key, "test-domain.file_test*");
        assert_eq!(m.counter_key, "file_test*");
    }
}

#[test]
fn share_threshold_middle_wildcard() {
    let c = config("share_threshold.yaml");
    for value in ["/api/v1", "/api-beta-v1", "/apiXYZv1"] {
        let m = hit(&c, "test-domain", &[("midpath", value)]);
        assert_eq!(m.rule.requests_per_unit, 100);
        assert_eq!(m.stats_key, "test-domain.midpath_/api*v1");
        assert_eq!(m.counter_key, "midpath_/api*v1");
    }
    assert!(get(&c, "test-domain", &[("midpath", "/api/v2")]).is_none());
}

#[test]
fn share_threshold_multi_wildcard() {
    let c = config("share_threshold.yaml");
    for value in ["svcAepBrpc", "svcXXXepYYYrpc", "svceprpc"] {
        let m = hit(&c, "test-domain", &[("multiroute", value)]);
        assert_eq!(m.rule.requests_per_unit, 50);
        assert_eq!(m.stats_key, "test-domain.multiroute_svc*ep*rpc");
        assert_eq!(m.counter_key, "multiroute_svc*ep*rpc");
    }
    assert!(get(&c, "test-domain", &[("multiroute", "svcABCrpc")]).is_none());
}

#[test]
fn share_threshold_over_value_to_metric_middle_wildcard() {
    let c = config("share_threshold.yaml");
    let a = hit(&c, "test-domain", &[("midroute", "/api/v2")]);
    let b = hit(&c, "test-domain", &[("midroute", "/api-beta-v2")]);
    assert_eq!(a.stats_key, "test-domain.midroute_/api*v2");
    assert_eq!(a.stats_key, b.stats_key);
    assert_eq!(a.counter_key, b.counter_key);
}

#[test]
fn share_threshold_nested_middle_wildcards() {
    let c = config("share_threshold.yaml");
    let a = hit(
        &c,
        "test-domain",
        &[("tenant", "t1prod"), ("resource", "resAv2")],
    );
    assert_eq!(a.stats_key, "test-domain.tenant_t*prod.resource_res*v2");
    assert_eq!(a.counter_key, "tenant_t*prod_resource_res*v2");
    let b = hit(
        &c,
        "test-domain",
        &[("tenant", "t99prod"), ("resource", "resBBBv2")],
    );
    assert_eq!(a.stats_key, b.stats_key);
    assert_eq!(a.counter_key, b.counter_key);
}

// ---------------------------------------------------------------- wildcard stats

fn one_wild(value: &str, flags: &str) -> RateLimitConfig {
    inline(&format!(
        "domain: test-domain\ndescriptors:\n  - key: wild\n    value: \"{value}\"\n{flags}    rate_limit: {{unit: minute, requests_per_unit: 20}}\n"
    ))
}

#[test]
fn wildcard_stats_no_flags() {
    let c = one_wild("foo*", "");
    let m = hit(&c, "test-domain", &[("wild", "foo1")]);
    assert_eq!(m.stats_key, "test-domain.wild_foo*");
    assert_eq!(m.stats_key, m.rule.full_key);
}

#[test]
fn wildcard_stats_value_to_metric() {
    let c = one_wild("foo*", "    value_to_metric: true\n");
    assert_eq!(
        hit(&c, "test-domain", &[("wild", "foo1")]).stats_key,
        "test-domain.wild_foo1"
    );
}

#[test]
fn wildcard_stats_share_threshold() {
    let c = one_wild("foo*", "    share_threshold: true\n");
    let m = hit(&c, "test-domain", &[("wild", "foo1")]);
    assert_eq!(m.stats_key, "test-domain.wild_foo*");
    assert_eq!(m.stats_key, m.rule.full_key);
}

#[test]
fn wildcard_stats_share_threshold_over_value_to_metric() {
    let c = one_wild(
        "foo*",
        "    share_threshold: true\n    value_to_metric: true\n",
    );
    assert_eq!(
        hit(&c, "test-domain", &[("wild", "foo1")]).stats_key,
        "test-domain.wild_foo*"
    );
}

#[test]
fn wildcard_stats_value_to_metric_elsewhere() {
    let c = inline(
        "
domain: test-domain
descriptors:
  - key: wild
    value: foo*
    descriptors:
      - key: other
        value_to_metric: true
        descriptors:
          - key: limit
            rate_limit: {unit: minute, requests_per_unit: 20}
",
    );
    let m = hit(
        &c,
        "test-domain",
        &[("wild", "foo1"), ("other", "bar"), ("limit", "X")],
    );
    assert_eq!(m.stats_key, "test-domain.wild_foo*.other_bar.limit");
}

#[test]
fn wildcard_stats_middle_and_trailing_no_flags() {
    let c = one_wild("foo*bar*", "");
    let a = hit(&c, "test-domain", &[("wild", "foo123bar456")]);
    let b = hit(&c, "test-domain", &[("wild", "fooXbarY")]);
    assert_eq!(a.stats_key, "test-domain.wild_foo*bar*");
    assert_eq!(a.stats_key, b.stats_key);
    assert_eq!(a.stats_key, a.rule.full_key);
}

#[test]
fn wildcard_stats_middle_and_trailing_value_to_metric() {
    let c = one_wild("foo*bar*", "    value_to_metric: true\n");
    assert_eq!(
        hit(&c, "test-domain", &[("wild", "foo123bar456")]).stats_key,
        "test-domain.wild_foo123bar456"
    );
}

// ---------------------------------------------------------------- metadata

#[test]
fn metadata() {
    let c = config("metadata.yaml");
    assert!(get(&c, "test-domain", &[]).is_none());
    let m = hit(
        &c,
        "test-domain",
        &[("key1", "value1"), ("subkey1", "something")],
    );
    assert_eq!(rpu_unit(&m), (5, Some(Unit::Second)));
    assert_eq!(m.stats_key, "test-domain.key1_value1.subkey1");
    let meta = c.metadata(&m.rule).expect("metadata of subkey1");
    assert_eq!(meta["name"], "service_1");

    let m = hit(&c, "test-domain", &[("key2", "something")]);
    assert_eq!(rpu_unit(&m), (20, Some(Unit::Minute)));
    let meta = c.metadata(&m.rule).expect("metadata of key2");
    assert_eq!(meta["service_with_quota"]["name"], "service_2");

    let m = hit(
        &c,
        "test-domain",
        &[("key1", "value1"), ("subkey1", "subvalue1")],
    );
    assert!(c.metadata(&m.rule).is_none());
}

// ---------------------------------------------------------------- integration files

#[test]
fn integration_runtime_files_load() {
    let c = load(
        &[
            "integration/another.yaml",
            "integration/basic.yaml",
            "integration/share_threshold.yaml",
            "integration/reload.yaml",
        ],
        false,
    )
    .unwrap();
    for d in ["another", "basic", "share-threshold-test", "reload"] {
        assert!(c.has_domain(d), "{d}");
    }
    assert_eq!(
        rpu_unit(&hit(&c, "basic", &[("key1", "foo")])),
        (50, Some(Unit::Second))
    );
    assert_eq!(
        rpu_unit(&hit(&c, "another", &[("key4", "x")])),
        (20, Some(Unit::Day))
    );
    // `key2_local` (no value) and key2 with value `local` are the same
    // composite key, as in envoyproxy.
    assert_eq!(
        hit(&c, "another", &[("key2", "local")]).rule.full_key,
        "another.key2_local"
    );
    let shared = hit(&c, "share-threshold-test", &[("files", "files/a")]);
    assert_eq!(shared.counter_key, "files_files/*");
    let apart = hit(
        &c,
        "share-threshold-test",
        &[("files_no_share", "files_no_share/a")],
    );
    assert_eq!(apart.counter_key, "files_no_share_files_no_share/a");
    assert_eq!(
        apart.stats_key,
        "share-threshold-test.files_no_share_files_no_share/*"
    );
    // requests_per_unit 0: a rule without a crate limit (every hit is over).
    let block = hit(&c, "reload", &[("block", "x")]);
    assert_eq!(block.rule.requests_per_unit, 0);
    assert!(block.rule.limit.is_none() && !block.rule.unlimited);
    assert_eq!(c.rules().len(), 6 + 3 + 2 + 3);
}

// ---------------------------------------------------------------- units, limits, dump

#[test]
fn units_as_envoyproxy_numbers_and_divides_them() {
    for (n, unit, secs) in [
        (1, Unit::Second, 1),
        (2, Unit::Minute, 60),
        (3, Unit::Hour, 3600),
        (4, Unit::Day, 86_400),
        (5, Unit::Month, 30 * 86_400),
        (6, Unit::Year, 365 * 86_400),
        (7, Unit::Week, 7 * 86_400),
    ] {
        assert_eq!(Unit::from_proto(n), Some(unit));
        assert_eq!(unit.to_proto(), n);
        assert_eq!(unit.seconds(), secs);
        assert_eq!(Unit::from_name(&unit.name().to_lowercase()), Some(unit));
    }
    assert_eq!(Unit::from_proto(0), None);
    assert_eq!(Unit::from_proto(8), None);
    assert_eq!(Unit::from_name("unknown"), None);
}

#[test]
fn every_rule_has_its_fixed_window_limit() {
    let c = inline(
        "domain: d\ndescriptors:\n  - key: m\n    rate_limit: {unit: month, requests_per_unit: 7}\n  - key: w\n    rate_limit: {unit: week, requests_per_unit: 8}\n",
    );
    let m = hit(&c, "d", &[("m", "x")]);
    let limit = m.rule.limit.as_ref().expect("a limit");
    assert_eq!(limit.quota().algorithm(), CrateAlgorithm::FixedWindow);
    assert_eq!(limit.capacity(), 7);
    // envoyproxy's month: 30 days from the epoch, not a calendar month.
    assert_eq!(limit.quota().window(), Duration::from_secs(30 * 86_400));
    assert_eq!(limit.quota().calendar(), None);
    let w = hit(&c, "d", &[("w", "x")]);
    assert_eq!(
        w.rule.limit.as_ref().map(|l| l.quota().window()),
        Some(Duration::from_secs(7 * 86_400))
    );
    // Limit names are distinct for every rule (wildcards and slashes too).
    let c = config("share_threshold.yaml");
    let names: std::collections::HashSet<_> = c
        .rules()
        .iter()
        .filter_map(|r| r.limit.as_ref().map(|l| l.name().to_string()))
        .collect();
    assert_eq!(names.len(), c.rules().len());
}

#[test]
fn dump_writes_a_line_per_rule() {
    let c = config("shadowmode_config.yaml");
    let dump = c.dump();
    let lines: Vec<&str> = dump.lines().collect();
    assert_eq!(lines.len(), 4);
    assert!(lines.contains(
        &"test-domain.key1_value1.subkey1_subvalue1: unit=SECOND requests_per_unit=10, shadow_mode: true, quota_mode: false"
    ));
    assert!(lines.contains(
        &"test-domain.key2: unit=MINUTE requests_per_unit=20, shadow_mode: true, quota_mode: false"
    ));
    let c = config("basic_config.yaml");
    assert!(c
        .dump()
        .lines()
        .any(|l| l == "test-domain.key6: unit=UNKNOWN requests_per_unit=0, shadow_mode: false, quota_mode: false"));
    assert_eq!(RateLimitConfig::default().dump(), "");
}

// ---------------------------------------------------------------- the extension

const TOWER_DOMAIN: &str = "
domain: api
tower_ratelimit: {}
descriptors:
  - key: plain
    rate_limit: {unit: minute, requests_per_unit: 10}
  - key: bucket
    rate_limit:
      unit: second
      requests_per_unit: 10
      tower_ratelimit: {algorithm: token_bucket, burst: 50}
  - key: gcra
    rate_limit:
      unit: second
      requests_per_unit: 5
      tower_ratelimit: {algorithm: gcra}
  - key: log
    rate_limit:
      unit: minute
      requests_per_unit: 3
      tower_ratelimit: {algorithm: sliding_log}
  - key: window
    rate_limit:
      requests_per_unit: 100
      tower_ratelimit: {algorithm: sliding_window, window: 15m}
  - key: odd
    rate_limit:
      unit: second
      requests_per_unit: 100
      tower_ratelimit: {window: 90s}
  - key: month
    rate_limit:
      requests_per_unit: 10000
      tower_ratelimit: {calendar: month, utc_offset: '+05:30'}
  - key: week
    rate_limit:
      unit: week
      requests_per_unit: 70
      tower_ratelimit: {algorithm: sliding_window, calendar: week, utc_offset: '-08:00'}
";

fn limit_of(c: &RateLimitConfig, key: &str) -> (Arc<Rule>, tower_ratelimit::Quota) {
    let m = hit(c, "api", &[(key, "x")]);
    assert!(m.tower, "a domain with the switch");
    let quota = *m.rule.limit.as_ref().expect("a limit").quota();
    (m.rule, quota)
}

#[test]
fn extension_blocks_map_to_the_crates_quotas() {
    let c = inline(TOWER_DOMAIN);
    assert!(c.domain("api").is_some_and(|d| d.tower));

    let (rule, q) = limit_of(&c, "plain");
    assert!(
        rule.extension.is_none(),
        "no block: the default fixed window"
    );
    assert_eq!(
        (q.algorithm(), q.capacity(), q.window()),
        (CrateAlgorithm::FixedWindow, 10, Duration::from_secs(60))
    );

    let (rule, q) = limit_of(&c, "bucket");
    let ext = rule.extension.as_ref().expect("extension");
    assert_eq!(
        (ext.algorithm, ext.burst),
        (Algorithm::TokenBucket, Some(50))
    );
    assert_eq!(
        (q.algorithm(), q.capacity(), q.refill()),
        (CrateAlgorithm::TokenBucket, 50, Some(10))
    );
    assert_eq!(q.window(), Duration::from_secs(1));

    let (_, q) = limit_of(&c, "gcra");
    assert_eq!(
        (q.algorithm(), q.capacity()),
        (CrateAlgorithm::Gcra, 5),
        "burst defaults to the rate"
    );

    let (_, q) = limit_of(&c, "log");
    assert_eq!(
        (q.algorithm(), q.capacity(), q.window()),
        (CrateAlgorithm::SlidingLog, 3, Duration::from_secs(60))
    );

    let (rule, q) = limit_of(&c, "window");
    assert_eq!(
        (q.algorithm(), q.window()),
        (CrateAlgorithm::SlidingWindow, Duration::from_secs(900))
    );
    // The unit left out: the longest that fits the window is reported.
    assert_eq!(rule.unit, Some(Unit::Minute));

    let (rule, q) = limit_of(&c, "odd");
    assert_eq!(
        (q.algorithm(), q.window()),
        (CrateAlgorithm::FixedWindow, Duration::from_secs(90))
    );
    assert_eq!(rule.unit, Some(Unit::Second), "a given unit is kept");

    let (rule, q) = limit_of(&c, "month");
    assert_eq!(q.calendar(), Some(Period::Month));
    assert_eq!(q.utc_offset_secs(), 5 * 3600 + 30 * 60);
    assert_eq!(rule.unit, Some(Unit::Month));
    assert_eq!(
        rule.extension.as_ref().and_then(|e| e.calendar),
        Some((Period::Month, 19_800))
    );

    let (_, q) = limit_of(&c, "week");
    assert_eq!(
        (q.algorithm(), q.calendar(), q.utc_offset_secs()),
        (CrateAlgorithm::SlidingWindow, Some(Period::Week), -8 * 3600)
    );

    assert!(c.dump().lines().any(|l| l.starts_with("api.bucket: unit=SECOND requests_per_unit=10, shadow_mode: false, quota_mode: false, tower_ratelimit: ")));
}

#[test]
fn extension_domain_default_algorithm() {
    let c = inline("domain: api\ntower_ratelimit: {algorithm: gcra}\ndescriptors:\n  - key: a\n    rate_limit: {unit: second, requests_per_unit: 4}\n  - key: b\n    rate_limit:\n      unit: second\n      requests_per_unit: 4\n      tower_ratelimit: {algorithm: fixed_window}\n");
    assert_eq!(limit_of(&c, "a").1.algorithm(), CrateAlgorithm::Gcra);
    assert_eq!(limit_of(&c, "b").1.algorithm(), CrateAlgorithm::FixedWindow);
}

#[test]
fn extension_off_by_default_and_existing_files_unchanged() {
    let c = config("basic_config.yaml");
    assert!(c.domain("test-domain").is_some_and(|d| !d.tower));
    assert!(c.rules().iter().all(|r| r.extension.is_none()));
}

#[test]
fn extension_errors() {
    let domain = |rule_block: &str| {
        format!("domain: api\ntower_ratelimit: {{}}\ndescriptors:\n  - key: k\n    rate_limit:\n      unit: second\n      requests_per_unit: 10\n      tower_ratelimit: {rule_block}\n")
    };
    // A per-rule block without the domain's switch: the file and key named.
    let e = inline_err("domain: api\ndescriptors:\n  - key: k\n    rate_limit:\n      unit: second\n      requests_per_unit: 10\n      tower_ratelimit: {algorithm: gcra}\n");
    assert!(e.starts_with("inline.yaml: the rate limit of 'api.k' has a `tower_ratelimit` block, but domain 'api' does not turn tower_ratelimit on"), "{e}");
    // The block elsewhere than beside `domain` or in a rate_limit.
    let e = inline_err("domain: api\ndescriptors:\n  - key: k\n    tower_ratelimit: {}\n");
    assert!(
        e.starts_with("inline.yaml: config error, unknown key 'tower_ratelimit' (line 4)"),
        "{e}"
    );
    for (block, expected) in [
        ("{algorithm: leaky}", "unknown algorithm 'leaky'"),
        (
            "{burst: 5}",
            "`burst` is for token_bucket and gcra, not fixed_window",
        ),
        (
            "{algorithm: gcra, burst: 0}",
            "`burst` must be a whole number of at least 1",
        ),
        ("{window: 90}", "`window` is a bare number"),
        ("{window: soon}", "`window` \"soon\" is not a duration"),
        ("{window: 0s}", "`window` must be longer than zero"),
        (
            "{window: 1m, calendar: day}",
            "`window` and `calendar` are two ways",
        ),
        (
            "{algorithm: token_bucket, calendar: day}",
            "`calendar` is for fixed_window and sliding_window, not token_bucket",
        ),
        ("{calendar: fortnight}", "unknown `calendar` 'fortnight'"),
        (
            "{utc_offset: '+01:00'}",
            "`utc_offset` goes with `calendar`",
        ),
        (
            "{calendar: day, utc_offset: '+25:00'}",
            "`utc_offset` '+25:00' is not an offset from UTC",
        ),
        (
            "{colour: red}",
            "config error, unknown key 'colour' in tower_ratelimit",
        ),
        ("5", "the block must be a mapping"),
    ] {
        let e = inline_err(&domain(block));
        assert!(e.starts_with("inline.yaml: "), "{e}");
        assert!(e.contains(expected), "{block}: {e}");
    }
    // Unlimited has nothing to shape.
    let e = inline_err("domain: api\ntower_ratelimit: {}\ndescriptors:\n  - key: k\n    rate_limit:\n      unlimited: true\n      tower_ratelimit: {algorithm: gcra}\n");
    assert!(e.contains("is unlimited"), "{e}");
    // The domain block takes only a default algorithm.
    let e = inline_err("domain: api\ntower_ratelimit: {burst: 4}\n");
    assert!(e.contains("takes only `algorithm`"), "{e}");
    // The unit is still required without a window.
    let e = inline_err(&domain("{algorithm: gcra}").replace("      unit: second\n", ""));
    assert_eq!(e, "inline.yaml: invalid rate limit unit ''");
    // Merged files of one domain must agree on the switch.
    let a = (
        "a.yaml".to_string(),
        "domain: api\ntower_ratelimit: {}\n".to_string(),
    );
    let b = ("b.yaml".to_string(), "domain: api\n".to_string());
    let e = RateLimitConfig::from_files(&[a, b], true).unwrap_err();
    assert_eq!(e.file, "b.yaml");
    assert!(e.message.contains("blocks differ"), "{e}");
}

// ---------------------------------------------------------------- the runtime folder

/// Waits (bounded) until `check` holds for the configuration in force.
fn wait_for(
    rx: &mut tokio::sync::watch::Receiver<Arc<RateLimitConfig>>,
    what: &str,
    check: impl Fn(&RateLimitConfig) -> bool,
) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if check(&rx.borrow_and_update()) {
            return;
        }
        assert!(Instant::now() < deadline, "not seen within 20 s: {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn rpu(c: &RateLimitConfig, domain: &str, key: &str) -> Option<u32> {
    c.get_limit(domain, &[(key, "v")])
        .map(|m| m.rule.requests_per_unit)
}

fn limit_yaml(domain: &str, n: u32) -> String {
    format!("domain: {domain}\ndescriptors:\n  - key: k\n    rate_limit: {{unit: second, requests_per_unit: {n}}}\n")
}

fn write(path: &Path, text: &str) {
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent).unwrap();
    }
    std::fs::write(path, text).unwrap();
}

/// A ConfigMap as Kubernetes mounts it: `dir/..TIMESTAMP/` with the files,
/// `dir/..data -> ..TIMESTAMP`, and `dir/NAME -> ..data/NAME`.
fn configmap(dir: &Path, version: &str, files: &[(&str, String)]) {
    let versioned = dir.join(format!("..{version}"));
    std::fs::create_dir_all(&versioned).unwrap();
    for (name, text) in files {
        write(&versioned.join(name), text);
    }
    // The atomic swap: a new link renamed over `..data`.
    let tmp = dir.join("..data_tmp");
    let _ = std::fs::remove_file(&tmp);
    std::os::unix::fs::symlink(format!("..{version}"), &tmp).unwrap();
    std::fs::rename(&tmp, dir.join("..data")).unwrap();
    for (name, _) in files {
        let link = dir.join(name);
        if std::fs::symlink_metadata(&link).is_err() {
            std::os::unix::fs::symlink(PathBuf::from("..data").join(name), &link).unwrap();
        }
    }
}

fn settings(root: &Path, watch_root: bool) -> RuntimeSettings {
    RuntimeSettings {
        root: root.to_path_buf(),
        subdirectory: "ratelimit".to_string(),
        ignore_dot_files: true,
        watch_root,
        debounce: Duration::from_millis(50),
        ..RuntimeSettings::default()
    }
}

#[test]
fn runtime_settings_from_the_environment() {
    let vars = |pairs: &'static [(&'static str, &'static str)]| {
        move |name: &str| {
            pairs
                .iter()
                .find(|(k, _)| *k == name)
                .map(|(_, v)| v.to_string())
        }
    };
    let s = RuntimeSettings::from_vars(vars(&[])).unwrap();
    assert_eq!(s, RuntimeSettings::default());
    assert_eq!(
        s.config_dir(),
        PathBuf::from("/srv/runtime_data/current/config")
    );
    assert!(s.watch_root && !s.ignore_dot_files && !s.merge_domains);
    // Istio's sample.
    let s = RuntimeSettings::from_vars(vars(&[
        ("RUNTIME_ROOT", "/data"),
        ("RUNTIME_SUBDIRECTORY", "ratelimit"),
        ("RUNTIME_WATCH_ROOT", "false"),
        ("RUNTIME_IGNOREDOTFILES", "true"),
        ("MERGE_DOMAIN_CONFIG", "1"),
    ]))
    .unwrap();
    assert_eq!(s.config_dir(), PathBuf::from("/data/ratelimit/config"));
    assert!(!s.watch_root && s.ignore_dot_files && s.merge_domains);
    let e = RuntimeSettings::from_vars(vars(&[("RUNTIME_WATCH_ROOT", "sometimes")])).unwrap_err();
    assert!(e.to_string().contains("RUNTIME_WATCH_ROOT"), "{e}");
}

#[test]
fn runtime_reads_the_files_as_goruntime_names_them() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("current");
    let config = root.join("ratelimit/config");
    write(&config.join("a.yaml"), &limit_yaml("a", 1));
    write(&config.join("sub/b.yml"), &limit_yaml("b", 2));
    write(&config.join(".hidden.yaml"), "not: [valid");
    write(&root.join("ratelimit/elsewhere.yaml"), &limit_yaml("z", 3));

    let s = settings(&root, true);
    let names: Vec<String> = read_files(&s)
        .unwrap()
        .into_iter()
        .map(|(n, _)| n)
        .collect();
    assert_eq!(names, ["config.a.yaml", "config.sub.b.yml"]);
    let s = RuntimeSettings {
        watch_root: false,
        ..settings(&root, false)
    };
    let names: Vec<String> = read_files(&s)
        .unwrap()
        .into_iter()
        .map(|(n, _)| n)
        .collect();
    assert_eq!(names, ["a.yaml", "sub.b.yml"]);
    // Dot files are read unless ignored (and this one is not YAML).
    let s = RuntimeSettings {
        ignore_dot_files: false,
        ..settings(&root, true)
    };
    assert_eq!(read_files(&s).unwrap().len(), 3);
    let (_rx, handle) = Runtime::start(s).unwrap();
    assert_eq!(handle.stats().errors(), 1);
    assert!(!handle.stats().loaded());
    let e = handle.stats().last_error().unwrap();
    assert_eq!(e.file, "config..hidden.yaml");
    // Not UTF-8: an error naming the file.
    std::fs::write(config.join("latin1.yaml"), b"domain: caf\xe9\n").unwrap();
    let e = read_files(&settings(&root, true)).unwrap_err();
    assert_eq!(e.file, "config.latin1.yaml");
    // A missing folder is no file.
    let s = settings(&tmp.path().join("nowhere"), true);
    assert!(read_files(&s).unwrap().is_empty());
}

#[test]
fn runtime_follows_a_configmap_symlink_swap() {
    // RUNTIME_WATCH_ROOT=true (the default), the ConfigMap mounted on the
    // config folder.
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("current");
    let dir = root.join("ratelimit/config");
    std::fs::create_dir_all(&dir).unwrap();
    configmap(&dir, "2026_01_01", &[("config.yaml", limit_yaml("api", 5))]);

    let (mut rx, handle) = Runtime::start(settings(&root, true)).unwrap();
    assert_eq!(rpu(&rx.borrow(), "api", "k"), Some(5));
    assert_eq!(handle.stats().successes(), 1);

    configmap(&dir, "2026_01_02", &[("config.yaml", limit_yaml("api", 6))]);
    wait_for(&mut rx, "the swapped ConfigMap", |c| {
        rpu(c, "api", "k") == Some(6)
    });

    // A bad version keeps the one in force, and counts an error.
    configmap(&dir, "2026_01_03", &[("config.yaml", "domain: api\ndescriptors:\n  - key: k\n    rate_limit: {unit: fortnight, requests_per_unit: 1}\n".to_string())]);
    let deadline = Instant::now() + Duration::from_secs(20);
    while handle.stats().errors() == 0 {
        assert!(Instant::now() < deadline, "the bad version was not read");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(
        rpu(&rx.borrow(), "api", "k"),
        Some(6),
        "the old configuration stays"
    );
    let e = handle.stats().last_error().unwrap();
    assert_eq!(
        e.to_string(),
        "config.config.yaml: invalid rate limit unit 'fortnight'"
    );

    configmap(&dir, "2026_01_04", &[("config.yaml", limit_yaml("api", 7))]);
    wait_for(&mut rx, "the fixed ConfigMap", |c| {
        rpu(c, "api", "k") == Some(7)
    });
    assert!(handle.stats().last_error().is_none());
    assert!(handle.stats().successes() >= 3);
}

#[test]
fn runtime_follows_a_root_symlink_swap() {
    // The layout goruntime's SymlinkRefresher watches: RUNTIME_ROOT itself
    // a symlink to a version folder.
    let tmp = tempfile::tempdir().unwrap();
    let v1 = tmp.path().join("v1");
    let v2 = tmp.path().join("v2");
    write(&v1.join("ratelimit/config/a.yaml"), &limit_yaml("a", 1));
    write(&v2.join("ratelimit/config/a.yaml"), &limit_yaml("a", 2));
    let root = tmp.path().join("current");
    std::os::unix::fs::symlink(&v1, &root).unwrap();

    let (mut rx, _handle) = Runtime::start(settings(&root, true)).unwrap();
    assert_eq!(rpu(&rx.borrow(), "a", "k"), Some(1));
    let tmp_link = tmp.path().join("current.tmp");
    std::os::unix::fs::symlink(&v2, &tmp_link).unwrap();
    std::fs::rename(&tmp_link, &root).unwrap();
    wait_for(&mut rx, "the swapped root", |c| rpu(c, "a", "k") == Some(2));
}

#[test]
fn runtime_follows_plain_rewrites_of_the_config_folder() {
    // RUNTIME_WATCH_ROOT=false: the config folder itself is watched.
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("data");
    let dir = root.join("ratelimit/config");
    write(&dir.join("a.yaml"), &limit_yaml("a", 1));

    let (mut rx, handle) = Runtime::start(settings(&root, false)).unwrap();
    assert_eq!(rpu(&rx.borrow(), "a", "k"), Some(1));

    write(&dir.join("a.yaml"), &limit_yaml("a", 2));
    wait_for(&mut rx, "the rewritten file", |c| {
        rpu(c, "a", "k") == Some(2)
    });

    write(&dir.join("b.yaml"), &limit_yaml("b", 3));
    wait_for(&mut rx, "a new file", |c| rpu(c, "b", "k") == Some(3));

    // A second file of domain a: refused (no MERGE_DOMAIN_CONFIG), kept.
    write(&dir.join("c.yaml"), &limit_yaml("a", 9));
    let deadline = Instant::now() + Duration::from_secs(20);
    while handle.stats().errors() == 0 {
        assert!(Instant::now() < deadline, "the duplicate was not read");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(rpu(&rx.borrow(), "a", "k"), Some(2));
    assert_eq!(rpu(&rx.borrow(), "b", "k"), Some(3));
    assert_eq!(
        handle.stats().last_error().unwrap().to_string(),
        "c.yaml: duplicate domain 'a' in config file"
    );

    std::fs::remove_file(dir.join("c.yaml")).unwrap();
    std::fs::remove_file(dir.join("b.yaml")).unwrap();
    wait_for(&mut rx, "the removed files", |c| {
        !c.has_domain("b") && rpu(c, "a", "k") == Some(2)
    });

    // The config folder removed and made again (beyond goruntime, which
    // loses its watch then).
    std::fs::remove_dir_all(&dir).unwrap();
    wait_for(&mut rx, "the removed folder", |c| c.is_empty());
    write(&dir.join("d.yaml"), &limit_yaml("d", 4));
    wait_for(&mut rx, "the folder made again", |c| {
        rpu(c, "d", "k") == Some(4)
    });
    write(&dir.join("d.yaml"), &limit_yaml("d", 5));
    wait_for(&mut rx, "a rewrite in the new folder", |c| {
        rpu(c, "d", "k") == Some(5)
    });

    // A reload on demand, and a receiver subscribed later.
    let reloaded = handle.reload().unwrap();
    assert!(reloaded.has_domain("d"));
    assert!(handle.subscribe().borrow().has_domain("d"));
}

#[test]
fn runtime_without_the_config_folder() {
    // RUNTIME_WATCH_ROOT=false needs the folder (goruntime's refresher
    // fails without it); with the root watched it is an empty
    // configuration until the folder appears in a new root version.
    let tmp = tempfile::tempdir().unwrap();
    let e = Runtime::start(settings(&tmp.path().join("none"), false)).unwrap_err();
    assert!(e.to_string().starts_with("cannot watch "), "{e}");
    let (rx, handle) = Runtime::start(settings(&tmp.path().join("none"), true)).unwrap();
    assert!(rx.borrow().is_empty());
    assert_eq!(handle.stats().successes(), 1);
}

// ---------------------------------------------------------------- windows as envoyproxy aligns them

#[tokio::test]
async fn default_limits_reset_where_envoyproxy_resets() {
    use tower_ratelimit::{Limiter, ManualClock, MemoryStore};
    // envoyproxy's CalculateReset: unit seconds - now % unit seconds.
    let now_secs: u64 = 1_765_000_123;
    let c = inline(
        "domain: d\ndescriptors:\n  - key: s\n    rate_limit: {unit: second, requests_per_unit: 2}\n  - key: h\n    rate_limit: {unit: hour, requests_per_unit: 2}\n  - key: w\n    rate_limit: {unit: week, requests_per_unit: 2}\n  - key: m\n    rate_limit: {unit: month, requests_per_unit: 2}\n  - key: y\n    rate_limit: {unit: year, requests_per_unit: 2}\n",
    );
    for key in ["s", "h", "w", "m", "y"] {
        let m = hit(&c, "d", &[(key, "v")]);
        let unit = m.rule.unit.unwrap();
        let clock = ManualClock::new(i64::try_from(now_secs).unwrap() * 1_000_000);
        let limiter = Limiter::new(
            MemoryStore::with_clock(clock),
            m.rule.limit.clone().unwrap(),
        );
        let d = limiter.check(m.counter_key.as_bytes(), 1).await.unwrap();
        assert!(d.is_allowed());
        let expected = Duration::from_secs(unit.seconds() - now_secs % unit.seconds());
        assert_eq!(d.reset_after(), expected, "{key}");
        let d = limiter.check(m.counter_key.as_bytes(), 2).await.unwrap();
        assert!(!d.is_allowed(), "{key}: a third hit in the window is over");
    }
}
