//! The `serve` command's flags, generated from the config's own definition.
//! Every key of `Config` can be set on the command line with
//! `--set section.key=value`, through the same code as the environment
//! (`config::apply_key`); a few common keys also have a flag of their own
//! (`--listen`, `--replica`, ...). The help text of every flag and the list
//! of keys under `prefixgate serve --help` come from the doc comments of the
//! config structs (through their schema) and the defaults from
//! `Config::default()`: nothing is typed twice.
//!
//! Precedence: command line > `PREFIXGATE_*` environment > file > default.

use std::path::PathBuf;

use clap::{Arg, ArgAction, ArgMatches, Command};
use utoipa::openapi::schema::Schema;
use utoipa::openapi::RefOr;

use crate::config::Config;

/// One config key, as the help lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyDoc {
    /// `section.key`, or a top-level `key`.
    pub key: String,
    /// The field's doc comment.
    pub doc: String,
    /// Its default, as TOML would write it (`-` for none).
    pub default: String,
}

/// Flags that are shorthands for config keys: (flag, key).
const SHORTHANDS: &[(&str, &str)] = &[
    ("listen", "listen"),
    ("admin-listen", "admin_listen"),
    ("data-dir", "data_dir"),
    ("store", "store.url"),
    ("policy", "policy"),
    ("replica", "replicas"),
    ("discover", "discovery"),
];

fn description(s: &RefOr<Schema>) -> String {
    let d = match s {
        RefOr::T(Schema::Object(o)) => o.description.clone(),
        RefOr::T(Schema::Array(a)) => a.description.clone(),
        RefOr::T(Schema::OneOf(o)) => o.description.clone(),
        RefOr::T(Schema::AllOf(a)) => a.description.clone(),
        RefOr::T(Schema::AnyOf(a)) => a.description.clone(),
        RefOr::Ref(r) => Some(r.description.clone()).filter(|d| !d.is_empty()),
        _ => None,
    };
    d.unwrap_or_default().split_whitespace().collect::<Vec<_>>().join(" ")
}

fn render(v: &serde_json::Value) -> String {
    match v {
        serde_json::Value::Null => "-".into(),
        serde_json::Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

/// An inlined section with defaults comes as `oneOf: [object]`: the object.
fn section(s: &RefOr<Schema>) -> Option<&RefOr<Schema>> {
    match s {
        RefOr::T(Schema::Object(o)) if !o.properties.is_empty() => Some(s),
        RefOr::T(Schema::OneOf(one)) if one.items.len() == 1 => section(&one.items[0]),
        _ => None,
    }
}

fn walk(schema: &RefOr<Schema>, prefix: &str, defaults: &serde_json::Value, out: &mut Vec<KeyDoc>) {
    let RefOr::T(Schema::Object(obj)) = schema else { return };
    for (name, prop) in &obj.properties {
        let key = if prefix.is_empty() { name.clone() } else { format!("{prefix}.{name}") };
        let default = &defaults[name.as_str()];
        match section(prop) {
            // A section (an inlined struct): its keys, one level down.
            Some(inner) if prefix.is_empty() => walk(inner, &key, default, out),
            _ => out.push(KeyDoc { key, doc: description(prop), default: render(default) }),
        }
    }
}

/// Every config key with its doc comment and default.
pub fn keys() -> Vec<KeyDoc> {
    let schema = <Config as utoipa::PartialSchema>::schema();
    let defaults = serde_json::to_value(Config::default()).expect("the default config serializes");
    let mut out = Vec::new();
    walk(&schema, "", &defaults, &mut out);
    out
}

/// `docs/configuration.md`: every config key, by section, with its doc
/// and default, from the same schema as the flags' help (`prefixgate
/// config-reference` prints it; a test compares the committed file).
pub fn configuration_markdown() -> String {
    let mut out = String::from(
        "# Configuration reference\n\n\
         Every key prefixgate reads, generated from the config's own definition \
         (`prefixgate config-reference > docs/configuration.md`; a test fails when \
         this page and the code differ). Each key can be set in the TOML file \
         (`--config FILE`: `[section]` then `key = value`), as an environment \
         variable (`PREFIXGATE_SECTION_KEY`, read as a TOML value), or on the \
         command line (`--set section.key=value`); the command line wins over \
         the environment, which wins over the file. A few keys have flags of \
         their own (`prefixgate serve --help`).\n",
    );
    let keys = keys();
    let section_of = |k: &KeyDoc| k.key.split_once('.').map_or(String::new(), |(s, _)| s.to_string());
    let mut sections: Vec<String> = keys.iter().map(section_of).collect();
    sections.dedup();
    sections.sort();
    sections.dedup();
    for section in sections {
        let title = if section.is_empty() { "Top-level keys".to_string() } else { format!("`[{section}]`") };
        out.push_str(&format!("\n## {title}\n\n| key | default | what it does |\n|---|---|---|\n"));
        for k in keys.iter().filter(|k| section_of(k) == section) {
            let default = k.default.replace('|', "\\|");
            let doc = k.doc.replace('|', "\\|");
            out.push_str(&format!("| `{}` | `{default}` | {doc} |\n", k.key));
        }
    }
    out
}

/// What `prefixgate serve` was told on its command line.
#[derive(Debug, Clone, Default)]
pub struct ServeArgs {
    /// A TOML config file.
    pub config: Option<PathBuf>,
    /// (dotted key, value), in the order given: shorthand flags, then `--set`.
    pub overrides: Vec<(String, String)>,
}

impl clap::Args for ServeArgs {
    fn augment_args(cmd: Command) -> Command {
        let keys = keys();
        let doc = |key: &str| keys.iter().find(|k| k.key == key).cloned().expect("a shorthand names a config key");
        let mut cmd = cmd
            .arg(
                Arg::new("config")
                    .long("config")
                    .value_name("FILE")
                    .value_parser(clap::value_parser!(PathBuf))
                    .help("TOML config file (see prefixgate.example.toml)"),
            )
            .arg(
                Arg::new("set")
                    .long("set")
                    .value_name("KEY=VALUE")
                    .action(ArgAction::Append)
                    .help("Sets any config key listed below, e.g. --set timeouts.connect_ms=500 (repeatable)"),
            );
        for (flag, key) in SHORTHANDS {
            let d = doc(key);
            let (many, value_name) = match *key {
                "replicas" => (true, "ID=URL"),
                "discovery" => (true, "URL"),
                _ => (false, "VALUE"),
            };
            cmd = cmd.arg(
                Arg::new(*flag)
                    .long(*flag)
                    .value_name(value_name)
                    .action(if many { ArgAction::Append } else { ArgAction::Set })
                    .help(format!("{} [key: {key}; default: {}]", d.doc, d.default)),
            );
        }
        let mut list = String::from(
            "Config keys (in the file as [section] key = value, as PREFIXGATE_SECTION_KEY, or --set section.key=value):\n",
        );
        for k in &keys {
            list.push_str(&format!("  {:<40} {} [default: {}]\n", k.key, k.doc, k.default));
        }
        cmd.after_long_help(list)
    }

    fn augment_args_for_update(cmd: Command) -> Command {
        Self::augment_args(cmd)
    }
}

impl clap::FromArgMatches for ServeArgs {
    fn from_arg_matches(m: &ArgMatches) -> Result<Self, clap::Error> {
        let mut overrides = Vec::new();
        for (flag, key) in SHORTHANDS {
            if let Some(values) = m.get_many::<String>(flag) {
                overrides.push((key.to_string(), values.cloned().collect::<Vec<_>>().join(",")));
            }
        }
        for kv in m.get_many::<String>("set").into_iter().flatten() {
            let (k, v) = kv.split_once('=').ok_or_else(|| {
                clap::Error::raw(clap::error::ErrorKind::InvalidValue, format!("--set expects KEY=VALUE, got '{kv}'\n"))
            })?;
            overrides.push((k.trim().to_string(), v.to_string()));
        }
        Ok(ServeArgs { config: m.get_one::<PathBuf>("config").cloned(), overrides })
    }

    fn update_from_arg_matches(&mut self, m: &ArgMatches) -> Result<(), clap::Error> {
        *self = Self::from_arg_matches(m)?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use clap::{Args, FromArgMatches};

    use super::*;

    #[test]
    fn every_key_has_its_doc_comment_and_default() {
        let keys = keys();
        let get = |k: &str| keys.iter().find(|d| d.key == k).unwrap_or_else(|| panic!("{k} listed")).clone();
        let connect = get("timeouts.connect_ms");
        assert!(connect.doc.starts_with("TCP connect to a replica"), "{connect:?}");
        assert_eq!(connect.default, "2000");
        assert_eq!(get("listen").default, "0.0.0.0:8080");
        assert_eq!(get("store.url").default, "-");
        assert!(
            keys.iter().all(|k| !k.doc.is_empty()),
            "undocumented: {:?}",
            keys.iter().filter(|k| k.doc.is_empty()).collect::<Vec<_>>()
        );
    }

    #[test]
    fn flags_become_overrides_in_order_and_load_wins_over_the_environment() {
        let cmd = ServeArgs::augment_args(Command::new("serve"));
        let m = cmd
            .try_get_matches_from([
                "serve",
                "--listen",
                "127.0.0.1:1",
                "--replica",
                "a=http://127.0.0.1:2",
                "--replica",
                "b=http://127.0.0.1:3",
                "--set",
                "timeouts.connect_ms=7",
                "--set",
                "policy=roundrobin",
            ])
            .unwrap();
        let args = ServeArgs::from_arg_matches(&m).unwrap();
        let env = [("PREFIXGATE_TIMEOUTS_CONNECT_MS".to_string(), "9".to_string())];
        let c = Config::load(None, env.into_iter(), &args.overrides).unwrap();
        assert_eq!(c.listen.to_string(), "127.0.0.1:1");
        assert_eq!(c.replicas.len(), 2);
        assert_eq!(c.timeouts.connect_ms, 7, "the command line beats the environment");
        assert_eq!(c.policy, crate::policy::Mode::RoundRobin);
        let bad = ServeArgs::augment_args(Command::new("serve"))
            .try_get_matches_from(["serve", "--set", "nonsense"])
            .unwrap();
        assert!(ServeArgs::from_arg_matches(&bad).is_err());
        let unknown = Config::load(None, std::iter::empty(), &[("timeouts.conect_ms".into(), "1".into())]).unwrap_err();
        assert!(unknown.contains("conect_ms"), "{unknown}");
    }
}
