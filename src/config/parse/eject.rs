//! A vserver's `eject`: passive ejection of the services that fail live requests
//! (docs/ejection.md). PURE.

use super::{Cx, Fields, join};
use crate::config::yaml::{Node, Value};
use crate::eject::EjectParams;
use std::time::Duration;

const EJECT_FIELDS: &[&str] = &["after", "base", "max", "max_fraction"];

impl Cx {
    /// `eject`: absent or `on` (the defaults), `off` (no ejection), or a mapping
    /// `{ after, base, max, max_fraction }` whose absent fields take their defaults.
    /// `Some(None)` is off; `None` a bad value (reported).
    pub(super) fn eject_field(&mut self, f: &Fields, path: &str) -> Option<Option<EjectParams>> {
        let Some(n) = f.get("eject") else {
            return Some(Some(EjectParams::DEFAULT));
        };
        let p = join(path, "eject");
        match &n.value {
            // `off` / `on` are YAML 1.1 booleans; read as words or as booleans alike.
            Value::Bool(false) => Some(None),
            Value::Bool(true) => Some(Some(EjectParams::DEFAULT)),
            Value::Str(s) if s == "off" => Some(None),
            Value::Str(s) if s == "on" => Some(Some(EjectParams::DEFAULT)),
            Value::Map(_) => self.eject(n, &p).map(Some),
            other => {
                self.problem(
                    n.pos,
                    &p,
                    format!(
                        "expected `off`, `on` or {{ after, base, max, max_fraction }}, found {}",
                        match other {
                            Value::Str(s) => format!("`{s}`"),
                            o => o.kind().to_owned(),
                        }
                    ),
                );
                None
            }
        }
    }

    /// `{ after, base, max, max_fraction }`, each optional.
    fn eject(&mut self, node: &Node, path: &str) -> Option<EjectParams> {
        let f = self.fields(node, path, EJECT_FIELDS)?;
        let d = EjectParams::DEFAULT;
        let after = self.int_field(&f, path, "after", (1, 1000), i128::from(d.after));
        let base = self.duration_field(&f, path, "base", Duration::from_nanos(d.base_ns), false);
        let max = self.duration_field(&f, path, "max", Duration::from_nanos(d.max_ns), false);
        let max_fraction = match f.get("max_fraction") {
            None => Some(d.max_fraction_e4),
            Some(n) => self.fraction(n, &join(path, "max_fraction")),
        };
        let (base, max) = (base?, max?);
        if max < base {
            // Reported where the operator wrote the value that is off.
            let field = if f.get("max").is_some() {
                "max"
            } else {
                "base"
            };
            let pos = f.get(field).map_or(f.pos, |n| n.pos);
            self.problem(
                pos,
                &join(path, field),
                "`max` (the longest ejection) must be at least `base` (the first one)",
            );
            return None;
        }
        let nanos = |d: Duration| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        Some(EjectParams {
            after: u32::try_from(after?).ok()?,
            base_ns: nanos(base),
            max_ns: nanos(max),
            max_fraction_e4: max_fraction?,
        })
    }

    /// A share from 0 to 1, kept in ten-thousandths.
    fn fraction(&mut self, n: &Node, path: &str) -> Option<u32> {
        let x = match n.value {
            Value::Float(x) => Some(x),
            Value::Int(i) => Some(i as f64),
            _ => None,
        };
        match x.filter(|x| (0.0..=1.0).contains(x)) {
            Some(x) => Some((x * 10_000.0).round() as u32),
            None => {
                self.problem(
                    n.pos,
                    path,
                    "expected a number in 0..=1 (the largest share of the vserver's services ejected at once)",
                );
                None
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::{MINIMAL, problems};
    use crate::config::from_str;
    use crate::eject::EjectParams;

    fn with(extra: &str) -> String {
        MINIMAL.replace("services: [s1] }", &format!("{extra}, services: [s1] }}"))
    }

    #[test]
    fn eject_is_on_by_default_and_off_by_word() {
        let c = from_str("t", MINIMAL).expect("valid");
        assert_eq!(c.vservers[0].eject, Some(EjectParams::DEFAULT));
        for off in ["eject: off", "eject: false", "eject: \"off\""] {
            let c = from_str("t", &with(off)).unwrap_or_else(|e| panic!("{off}: {e}"));
            assert_eq!(c.vservers[0].eject, None, "{off}");
        }
        let c = from_str("t", &with("eject: on")).expect("valid");
        assert_eq!(c.vservers[0].eject, Some(EjectParams::DEFAULT));
    }

    #[test]
    fn eject_fields_take_their_defaults() {
        let c = from_str(
            "t",
            &with("eject: { after: 5, base: 300ms, max_fraction: 0.34 }"),
        )
        .expect("valid");
        assert_eq!(
            c.vservers[0].eject,
            Some(EjectParams {
                after: 5,
                base_ns: 300_000_000,
                max_ns: 300_000_000_000,
                max_fraction_e4: 3_400,
            })
        );
        let c = from_str("t", &with("eject: { max_fraction: 1, max: 10s }")).expect("valid");
        let e = c.vservers[0].eject.expect("on");
        assert_eq!(
            (e.max_fraction_e4, e.max_ns, e.after),
            (10_000, 10_000_000_000, 3)
        );
    }

    #[test]
    fn bad_eject_values_are_reported_where_written() {
        for (extra, path, says) in [
            (
                "eject: { after: 0 }",
                "vservers[0].eject.after",
                "out of range 1..=1000",
            ),
            (
                "eject: { base: 0s }",
                "vservers[0].eject.base",
                "greater than 0",
            ),
            (
                "eject: { base: 1m, max: 30s }",
                "vservers[0].eject.max",
                "at least `base`",
            ),
            (
                "eject: { base: 10m }",
                "vservers[0].eject.base",
                "at least `base`",
            ),
            (
                "eject: { max_fraction: 1.5 }",
                "vservers[0].eject.max_fraction",
                "0..=1",
            ),
            (
                "eject: { max_fraction: half }",
                "vservers[0].eject.max_fraction",
                "0..=1",
            ),
            (
                "eject: { afer: 2 }",
                "vservers[0].eject.afer",
                "did you mean `after`",
            ),
            (
                "eject: sometimes",
                "vservers[0].eject",
                "expected `off`, `on`",
            ),
            ("eject: 3", "vservers[0].eject", "expected `off`, `on`"),
        ] {
            let p = problems(&with(extra));
            assert_eq!(p.len(), 1, "{extra}: {p:?}");
            assert_eq!((p[0].0, p[0].1.as_str()), (4, path), "{extra}: {p:?}");
            assert!(p[0].2.contains(says), "{extra}: {p:?}");
        }
    }
}
