//! Loading one file into the configuration, checked as envoyproxy/ratelimit
//! checks it (`ConfigFileContentToYaml`, `validateYamlKeys`, `loadConfig`,
//! `loadDescriptors` in its `src/config/config_impl.go`), in the same order,
//! with the same messages; then the opt-in `tower_ratelimit` blocks.

use std::sync::Arc;

use super::tower;
use super::yaml::{self, Kind, Node};
use super::{ConfigError, Descriptor, Domain, DomainTree, RateLimitConfig, Rule, Unit};

/// The keys envoyproxy/ratelimit knows, anywhere in a file.
const VALID_KEYS: [&str; 16] = [
    "domain",
    "key",
    "value",
    "descriptors",
    "rate_limit",
    "unit",
    "requests_per_unit",
    "unlimited",
    "shadow_mode",
    "quota_mode",
    "name",
    "replaces",
    "detailed_metric",
    "value_to_metric",
    "share_threshold",
    "metadata",
];

/// The opt-in block's key: allowed beside `domain` and inside a `rate_limit`.
pub(super) const TOWER: &str = "tower_ratelimit";

/// Where a mapping is, for the keys allowed in it.
#[derive(Clone, Copy, PartialEq)]
enum Place {
    /// The file's top level (`domain`, `descriptors`; and `tower_ratelimit`).
    Top,
    /// A `rate_limit` (and `tower_ratelimit`).
    RateLimit,
    /// A `tower_ratelimit` block: only its own keys.
    Tower,
    /// Anywhere else.
    Other,
}

/// Loads one file (`name`: as errors name it) into `config`.
pub(super) fn load_file(
    config: &mut RateLimitConfig,
    name: &str,
    text: &str,
    merge_domains: bool,
) -> Result<(), ConfigError> {
    let err = |message: String| ConfigError {
        file: name.to_string(),
        message,
    };
    let root =
        yaml::parse(text).map_err(|e| err(format!("error loading config file: yaml: {e}")))?;
    let root = match &root.kind {
        Kind::Map(_) => root,
        Kind::Null(_) => Node {
            kind: Kind::Map(Vec::new()),
            line: root.line,
        },
        _ => return Err(err(unmarshal(&root, "map[interface {}]interface {}"))),
    };
    validate_keys(&root, Place::Top).map_err(err)?;

    // The typed reading (yaml.v2's second Unmarshal, into YamlRoot): the
    // whole document's types before any of the checks below, as in Go.
    check_types(&root).map_err(err)?;
    let domain = string_field(&root, "domain").map_err(err)?;
    let descriptors = descriptor_list(&root).map_err(err)?;
    let tower_block = match root.get(TOWER) {
        None => None,
        Some(block) => Some(tower::domain_block(block).map_err(err)?),
    };

    if domain.is_empty() {
        return Err(err("config file cannot have empty domain".to_string()));
    }
    let settings = Domain {
        tower: tower_block.is_some(),
    };
    let default_algorithm = tower_block.and_then(|b| b.algorithm);
    let mut loader = Loader {
        file: name,
        domain: &domain,
        tower: settings.tower,
        default_algorithm,
        rules: Vec::new(),
        metadata: Vec::new(),
    };
    match config.domains.get_mut(&domain) {
        Some(existing) => {
            if !merge_domains {
                return Err(err(format!("duplicate domain '{domain}' in config file")));
            }
            if existing.settings.tower != settings.tower
                || existing.default_algorithm != default_algorithm
            {
                return Err(err(format!(
                    "domain '{domain}' is merged from files whose `{TOWER}` blocks differ; \
                     write the same block (or none) in every file of the domain"
                )));
            }
            let prefix = format!("{domain}.");
            loader.load(&mut existing.root, &prefix, &[], descriptors)?;
        }
        None => {
            let mut tree = DomainTree {
                settings,
                default_algorithm,
                root: Descriptor::default(),
            };
            let prefix = format!("{domain}.");
            loader.load(&mut tree.root, &prefix, &[], descriptors)?;
            config.domains.insert(domain.clone(), tree);
        }
    }
    let Loader {
        rules, metadata, ..
    } = loader;
    config.rules.extend(rules);
    config.metadata.extend(metadata);
    Ok(())
}

/// `validateYamlKeys`: every key a string and known, every list a list of
/// mappings, every leaf a string, an integer, a boolean or null.
fn validate_keys(map: &Node, place: Place) -> Result<(), String> {
    let Some(entries) = map.as_map() else {
        return Ok(());
    };
    for (key, value) in entries {
        let Kind::Str(k) = &key.kind else {
            return Err(format!(
                "config error, key is not of type string: {}",
                key.go_format()
            ));
        };
        let known = match place {
            Place::Tower => tower::KEYS.contains(&k.as_str()),
            Place::Top | Place::RateLimit => VALID_KEYS.contains(&k.as_str()) || k == TOWER,
            Place::Other => VALID_KEYS.contains(&k.as_str()),
        };
        if !known {
            if place == Place::Tower {
                return Err(format!(
                    "config error, unknown key '{k}' in {TOWER} (line {}; it takes {})",
                    key.line,
                    tower::KEYS.join(", ")
                ));
            }
            if k == TOWER {
                return Err(format!(
                    "config error, unknown key '{k}' (line {}): a {TOWER} block goes beside \
                     `domain` or inside a `rate_limit`",
                    key.line
                ));
            }
            return Err(format!("config error, unknown key '{k}'"));
        }
        if k == "metadata" {
            // Arbitrary keys and values: checked when converted.
            continue;
        }
        let inner = match (place, k.as_str()) {
            (Place::Tower, _) => Place::Tower,
            (_, "rate_limit") => Place::RateLimit,
            (_, TOWER) => Place::Tower,
            _ => Place::Other,
        };
        match &value.kind {
            Kind::Seq(items) => {
                for item in items {
                    if item.as_map().is_none() {
                        return Err(format!(
                            "config error, yaml file contains list of type other than map: {}",
                            item.go_format()
                        ));
                    }
                    validate_keys(item, inner)?;
                }
            }
            Kind::Map(_) => validate_keys(value, inner)?,
            Kind::Str(_) | Kind::Bool(..) | Kind::Null(_) => {}
            // Go's int is 64 bits: a larger integer decodes as another type.
            Kind::Int(i, _) if i64::try_from(*i).is_ok() => {}
            Kind::Int(..) | Kind::Float(..) => return Err("error checking config".to_string()),
        }
    }
    Ok(())
}

/// yaml.v2's message for a value that does not fit its field.
pub(super) fn unmarshal(node: &Node, into: &str) -> String {
    let (tag, shown) = match &node.kind {
        Kind::Null(t) => ("!!null", Some(t.as_str())),
        Kind::Bool(_, t) => ("!!bool", Some(t.as_str())),
        Kind::Int(_, t) => ("!!int", Some(t.as_str())),
        Kind::Float(_, t) => ("!!float", Some(t.as_str())),
        Kind::Str(t) => ("!!str", Some(t.as_str())),
        Kind::Seq(_) => ("!!seq", None),
        Kind::Map(_) => ("!!map", None),
    };
    let what = match shown {
        Some(text) => {
            let short: String = text.chars().take(40).collect();
            format!("{tag} `{short}`")
        }
        None => tag.to_string(),
    };
    format!(
        "error loading config file: yaml: unmarshal errors:\n  line {}: cannot unmarshal {what} into {into}",
        node.line
    )
}

/// A string field: any scalar's text; absent or null: empty.
pub(super) fn string_field(map: &Node, name: &str) -> Result<String, String> {
    match map.get(name) {
        None => Ok(String::new()),
        Some(node) if node.is_null() => Ok(String::new()),
        Some(node) => node
            .scalar_text()
            .map(str::to_string)
            .ok_or_else(|| unmarshal(node, "string")),
    }
}

/// A boolean field: a YAML boolean; absent or null: false.
fn bool_field(map: &Node, name: &str) -> Result<bool, String> {
    match map.get(name) {
        None => Ok(false),
        Some(node) => match &node.kind {
            Kind::Null(_) => Ok(false),
            Kind::Bool(b, _) => Ok(*b),
            _ => Err(unmarshal(node, "bool")),
        },
    }
}

/// `requests_per_unit`: an integer from 0 to 2^32-1; absent or null: 0.
fn u32_field(map: &Node, name: &str) -> Result<u32, String> {
    match map.get(name) {
        None => Ok(0),
        Some(node) => match &node.kind {
            Kind::Null(_) => Ok(0),
            Kind::Int(i, _) => u32::try_from(*i).map_err(|_| unmarshal(node, "uint32")),
            _ => Err(unmarshal(node, "uint32")),
        },
    }
}

/// A `descriptors` list (absent or null: none).
fn descriptor_list(map: &Node) -> Result<&[Node], String> {
    match map.get("descriptors") {
        None => Ok(&[]),
        Some(node) => match &node.kind {
            Kind::Null(_) => Ok(&[]),
            Kind::Seq(items) => {
                for item in items {
                    if item.as_map().is_none() {
                        return Err(unmarshal(item, "config.YamlDescriptor"));
                    }
                }
                Ok(items)
            }
            _ => Err(unmarshal(node, "[]config.YamlDescriptor")),
        },
    }
}

/// Every field of a file read as its Go type, as yaml.v2 decodes the whole
/// document into `YamlRoot` before `loadConfig` checks anything.
fn check_types(root: &Node) -> Result<(), String> {
    string_field(root, "domain")?;
    check_descriptors(descriptor_list(root)?, 0)
}

fn check_descriptors(descriptors: &[Node], depth: usize) -> Result<(), String> {
    for d in descriptors {
        string_field(d, "key")?;
        string_field(d, "value")?;
        for flag in [
            "shadow_mode",
            "quota_mode",
            "detailed_metric",
            "value_to_metric",
            "share_threshold",
        ] {
            bool_field(d, flag)?;
        }
        if let Some(meta) = d.get("metadata") {
            if !matches!(meta.kind, Kind::Null(_) | Kind::Map(_)) {
                return Err(unmarshal(meta, "map[string]interface {}"));
            }
        }
        match d.get("rate_limit") {
            Some(rl) if rl.as_map().is_some() => {
                u32_field(rl, "requests_per_unit")?;
                string_field(rl, "unit")?;
                bool_field(rl, "unlimited")?;
                string_field(rl, "name")?;
                match rl.get("replaces") {
                    None => {}
                    Some(n) => match &n.kind {
                        Kind::Null(_) => {}
                        Kind::Seq(items) => {
                            for item in items {
                                if item.as_map().is_none() {
                                    return Err(unmarshal(item, "config.yamlReplaces"));
                                }
                                string_field(item, "name")?;
                            }
                        }
                        _ => return Err(unmarshal(n, "[]config.yamlReplaces")),
                    },
                }
            }
            Some(rl) if !rl.is_null() => return Err(unmarshal(rl, "config.YamlRateLimit")),
            _ => {}
        }
        // (The parser bounds the depth; this keeps the walk's own bound.)
        if depth < 128 {
            check_descriptors(descriptor_list(d)?, depth + 1)?;
        }
    }
    Ok(())
}

/// What loading a file adds.
struct Loader<'a> {
    file: &'a str,
    domain: &'a str,
    tower: bool,
    default_algorithm: Option<super::Algorithm>,
    rules: Vec<Arc<Rule>>,
    metadata: Vec<(String, Arc<serde_json::Map<String, serde_json::Value>>)>,
}

impl Loader<'_> {
    fn err(&self, message: impl Into<String>) -> ConfigError {
        ConfigError {
            file: self.file.to_string(),
            message: message.into(),
        }
    }

    /// `loadDescriptors`: one level, then each descriptor's own.
    fn load(
        &mut self,
        level: &mut Descriptor,
        parent_key: &str,
        parent_path: &[String],
        descriptors: &[Node],
    ) -> Result<(), ConfigError> {
        for node in descriptors {
            let key = string_field(node, "key").map_err(|e| self.err(e))?;
            let value = string_field(node, "value").map_err(|e| self.err(e))?;
            let children = descriptor_list(node).map_err(|e| self.err(e))?;
            let flag = |name: &str| bool_field(node, name).map_err(|e| self.err(e));
            for name in ["shadow_mode", "quota_mode", "detailed_metric"] {
                flag(name)?;
            }
            let value_to_metric = flag("value_to_metric")?;
            let share_threshold = flag("share_threshold")?;
            let rate_limit = match node.get("rate_limit") {
                None => None,
                Some(n) if n.is_null() => None,
                Some(n) if n.as_map().is_some() => Some(n),
                Some(n) => return Err(self.err(unmarshal(n, "config.YamlRateLimit"))),
            };

            if key.is_empty() {
                return Err(self.err("descriptor has empty key"));
            }
            let final_key = if value.is_empty() {
                key.clone()
            } else {
                format!("{key}_{value}")
            };
            let full_key = format!("{parent_key}{final_key}");
            if level.children.contains_key(&final_key) {
                return Err(self.err(format!("duplicate descriptor composite key '{full_key}'")));
            }

            let mut path = parent_path.to_vec();
            path.push(final_key.clone());
            let rule = match rate_limit {
                Some(rl) => Some(self.rule(rl, &full_key, &path, node)?),
                None => None,
            };

            if share_threshold && !final_key.contains('*') {
                return Err(self.err(format!(
                    "share_threshold can only be used with wildcard values (containing '*'), \
                     but found key '{final_key}'"
                )));
            }
            let wildcard_pattern = if share_threshold {
                final_key.clone()
            } else {
                String::new()
            };
            if final_key.contains('*') {
                let parts = final_key.split('*').map(str::to_string).collect();
                level.wildcards.push((final_key.clone(), parts));
            }
            if let Some(meta) = node.get("metadata") {
                if let Some(map) =
                    metadata(meta).map_err(|e| self.err(format!("error parsing metadata: {e}")))?
                {
                    self.metadata.push((full_key.clone(), Arc::new(map)));
                }
            }

            let mut descriptor = Descriptor {
                children: Default::default(),
                wildcards: Vec::new(),
                rule: rule.clone(),
                value_to_metric,
                share_threshold,
                wildcard_pattern,
            };
            if let Some(rule) = rule {
                self.rules.push(rule);
            }
            self.load(&mut descriptor, &format!("{full_key}."), &path, children)?;
            level.children.insert(final_key, descriptor);
        }
        Ok(())
    }

    /// A descriptor's `rate_limit`, checked as envoyproxy checks it, with
    /// its crate limit.
    fn rule(
        &self,
        rl: &Node,
        full_key: &str,
        path: &[String],
        descriptor: &Node,
    ) -> Result<Arc<Rule>, ConfigError> {
        let e = |m: String| self.err(m);
        let requests_per_unit = u32_field(rl, "requests_per_unit").map_err(e)?;
        let unit_text = string_field(rl, "unit").map_err(e)?;
        let unlimited = bool_field(rl, "unlimited").map_err(e)?;
        let name = string_field(rl, "name").map_err(e)?;
        let replaces = match rl.get("replaces") {
            None => Vec::new(),
            Some(n) if n.is_null() => Vec::new(),
            Some(n) => match &n.kind {
                Kind::Seq(items) => items
                    .iter()
                    .map(|item| match item.kind {
                        Kind::Map(_) => string_field(item, "name"),
                        _ => Err(unmarshal(item, "config.yamlReplaces")),
                    })
                    .collect::<Result<Vec<_>, _>>()
                    .map_err(e)?,
                _ => return Err(self.err(unmarshal(n, "[]config.yamlReplaces"))),
            },
        };
        let flag = |name: &str| bool_field(descriptor, name).map_err(|m| self.err(m));

        let unit = Unit::from_name(&unit_text);
        if unlimited && unit.is_some() {
            return Err(self.err("should not specify rate limit unit when unlimited"));
        }
        let block = rl.get(super::load::TOWER);
        // The unit may be left out where the opt-in block gives a window.
        let window_given = block.is_some_and(tower::gives_window);
        if !unlimited && unit.is_none() && !(unit_text.is_empty() && window_given) {
            return Err(self.err(format!("invalid rate limit unit '{unit_text}'")));
        }
        for replaced in &replaces {
            if replaced.is_empty() {
                return Err(self.err("should not have an empty replaces entry"));
            }
            if *replaced == name {
                return Err(self.err("replaces should not contain name of same descriptor"));
            }
        }

        let extension = match block {
            Some(block) => {
                if !self.tower {
                    return Err(self.err(format!(
                        "the rate limit of '{full_key}' has a `{TOWER}` block, but domain '{}' \
                         does not turn {TOWER} on: add `{TOWER}: {{}}` beside `domain: {}`",
                        self.domain, self.domain
                    )));
                }
                if unlimited {
                    return Err(self.err(format!(
                        "the rate limit of '{full_key}' is unlimited: its `{TOWER}` block has \
                         nothing to apply to"
                    )));
                }
                Some(
                    tower::rule_block(block, self.default_algorithm)
                        .map_err(|m| self.err(format!("{TOWER} of '{full_key}': {m}")))?,
                )
            }
            None if !unlimited => self.default_algorithm.map(super::Extension::with_algorithm),
            None => None,
        };
        let unit = match (unlimited, unit, &extension) {
            (true, _, _) => None,
            (false, Some(unit), _) => Some(unit),
            (false, None, Some(ext)) => Some(tower::unit_of(ext)),
            // Refused above: a unit is required without a window.
            (false, None, None) => {
                return Err(self.err(format!("invalid rate limit unit '{unit_text}'")))
            }
        };
        let limit = match unit {
            Some(unit) if requests_per_unit > 0 => Some(
                tower::limit(
                    self.domain,
                    path,
                    requests_per_unit,
                    unit,
                    extension.as_ref(),
                )
                .map_err(|m| match &extension {
                    Some(_) => self.err(format!("{TOWER} of '{full_key}': {m}")),
                    None => self.err(format!("rate limit of '{full_key}': {m}")),
                })?,
            ),
            _ => None,
        };
        Ok(Arc::new(Rule {
            full_key: full_key.to_string(),
            requests_per_unit,
            unit,
            unlimited,
            shadow_mode: flag("shadow_mode")?,
            quota_mode: flag("quota_mode")?,
            name: (!name.is_empty()).then_some(name),
            replaces,
            detailed_metric: flag("detailed_metric")?,
            value_to_metric: flag("value_to_metric")?,
            share_threshold: flag("share_threshold")?,
            extension,
            limit,
        }))
    }
}

/// A descriptor's `metadata` as JSON (`None` when empty), keys as text.
fn metadata(node: &Node) -> Result<Option<serde_json::Map<String, serde_json::Value>>, String> {
    match &node.kind {
        Kind::Null(_) => Ok(None),
        Kind::Map(entries) if entries.is_empty() => Ok(None),
        Kind::Map(_) => match json(node)? {
            serde_json::Value::Object(map) => Ok(Some(map)),
            _ => Ok(None),
        },
        _ => Err(unmarshal(node, "map[string]interface {}")),
    }
}

fn json(node: &Node) -> Result<serde_json::Value, String> {
    use serde_json::Value;
    Ok(match &node.kind {
        Kind::Null(_) => Value::Null,
        Kind::Bool(b, _) => Value::Bool(*b),
        Kind::Int(i, text) => match (i64::try_from(*i), u64::try_from(*i)) {
            (Ok(v), _) => Value::from(v),
            (_, Ok(v)) => Value::from(v),
            _ => {
                return Err(format!(
                    "line {}: the integer {text} is out of range",
                    node.line
                ))
            }
        },
        Kind::Float(f, text) => match serde_json::Number::from_f64(*f) {
            Some(n) => Value::Number(n),
            None => return Err(format!("line {}: {text} is not a finite number", node.line)),
        },
        Kind::Str(s) => Value::String(s.clone()),
        Kind::Seq(items) => Value::Array(items.iter().map(json).collect::<Result<_, _>>()?),
        Kind::Map(entries) => {
            let mut map = serde_json::Map::new();
            for (k, v) in entries {
                let key = k
                    .scalar_text()
                    .map_or_else(|| k.go_format(), str::to_string);
                map.insert(key, json(v)?);
            }
            Value::Object(map)
        }
    })
}
