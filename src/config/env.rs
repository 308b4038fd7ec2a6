//! `${NAME}` in a config: the value of environment variable NAME, anywhere a scalar is written
//! (HAProxy's configs do the same), so one file serves every instance of a pool, each with its
//! own address (`service_source: "${FULCRUM_UNICAST}:5060"`). `${NAME:-default}` gives `default`
//! when NAME is unset or empty. A reference to an unset variable without a default is a
//! problem at the field that holds it. PURE: the environment is passed in.
//!
//! A scalar that becomes a whole number (or `true` / `false`) is read as one, as YAML would
//! read the value written in place of the reference (`port: ${PORT}`).

use super::parse::Problem;
use super::yaml::{Node, Value};

/// Replace every `${NAME}` / `${NAME:-default}` in the scalars under `node` (whose field path
/// is `path`), reporting undefined variables and malformed references into `problems`.
pub(crate) fn substitute(
    node: &mut Node,
    path: &str,
    env: &dyn Fn(&str) -> Option<String>,
    problems: &mut Vec<Problem>,
) {
    let pos = node.pos;
    match &mut node.value {
        Value::Str(s) if s.contains("${") => match expand(s, env) {
            Ok(v) => node.value = reread(v),
            Err(message) => problems.push(Problem {
                pos,
                path: path.to_owned(),
                message,
            }),
        },
        Value::Seq(items) => {
            for (i, n) in items.iter_mut().enumerate() {
                substitute(n, &format!("{path}[{i}]"), env, problems);
            }
        }
        Value::Map(entries) => {
            for (k, n) in entries.iter_mut() {
                let p = if path.is_empty() {
                    k.name.clone()
                } else {
                    format!("{path}.{}", k.name)
                };
                substitute(n, &p, env, problems);
            }
        }
        _ => {}
    }
}

/// `s` with its references replaced.
fn expand(s: &str, env: &dyn Fn(&str) -> Option<String>) -> Result<String, String> {
    let mut out = String::with_capacity(s.len());
    let mut rest = s;
    while let Some(at) = rest.find("${") {
        out.push_str(&rest[..at]);
        let after = &rest[at + 2..];
        let end = after
            .find('}')
            .ok_or_else(|| format!("`${{` without a closing `}}` in `{s}`"))?;
        let inner = &after[..end];
        let (name, default) = match inner.split_once(":-") {
            Some((n, d)) => (n, Some(d)),
            None => (inner, None),
        };
        let valid = name
            .chars()
            .next()
            .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
            && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
        if !valid {
            return Err(format!(
                "`${{{inner}}}` is not an environment variable reference (NAME: letters, digits, _)"
            ));
        }
        match (env(name).filter(|v| !v.is_empty()), default) {
            (Some(v), _) => out.push_str(&v),
            (None, Some(d)) => out.push_str(d),
            (None, None) => return Err(format!("environment variable `{name}` is not set")),
        }
        rest = &after[end + 1..];
    }
    out.push_str(rest);
    Ok(out)
}

/// The value an expanded scalar stands for: a whole number or a boolean as YAML reads one.
fn reread(v: String) -> Value {
    if let Ok(i) = v.parse::<i128>() {
        return Value::Int(i);
    }
    match v.as_str() {
        "true" => Value::Bool(true),
        "false" => Value::Bool(false),
        _ => Value::Str(v),
    }
}

#[cfg(test)]
mod tests {
    use crate::config::{ConfigError, from_str_with_env};

    fn env(name: &str) -> Option<String> {
        match name {
            "UNICAST" => Some("10.0.0.7".into()),
            "PORT" => Some("5071".into()),
            "EMPTY" => Some(String::new()),
            _ => None,
        }
    }

    const YAML: &str = "services:\n  - { name: s1, address: \"${UNICAST}:${PORT}\", protocol: sip-udp, weight: \"${WEIGHT:-3}\" }\nvservers:\n  - { name: v, protocol: sip-udp, bind: \"127.0.0.1:${VPORT:-5060}\", max_sessions: \"${PORT}\", advertise: \"${EMPTY:-sip.example.com}:5060\", services: [s1] }\n";

    #[test]
    fn references_take_the_environment_or_their_default() {
        let c = from_str_with_env("t", YAML, &env).expect("valid");
        assert_eq!(c.services[0].address.to_string(), "10.0.0.7:5071");
        assert_eq!(c.services[0].weight, 3);
        assert_eq!(c.vservers[0].bind[0].to_string(), "127.0.0.1:5060");
        assert_eq!(c.vservers[0].max_sessions, 5071);
        assert_eq!(
            c.vservers[0].advertise.as_deref(),
            Some("sip.example.com:5060")
        );
    }

    #[test]
    fn an_unset_variable_is_a_problem_at_its_field() {
        let text = YAML.replace("${PORT}\"", "${NO_SUCH}\"");
        let Err(ConfigError::Invalid { problems, .. }) = from_str_with_env("t", &text, &env) else {
            panic!("accepted");
        };
        let got: Vec<(u32, &str, &str)> = problems
            .iter()
            .map(|p| (p.pos.line, p.path.as_str(), p.message.as_str()))
            .collect();
        let unset = "environment variable `NO_SUCH` is not set";
        assert_eq!(
            got,
            [
                (2, "services[0].address", unset),
                (4, "vservers[0].max_sessions", unset)
            ]
        );
        let text = YAML.replace("${PORT}\"", "${9X}\"");
        assert!(from_str_with_env("t", &text, &env).is_err());
        let text = YAML.replace("${PORT}\"", "${PORT\"");
        assert!(from_str_with_env("t", &text, &env).is_err());
    }
}
