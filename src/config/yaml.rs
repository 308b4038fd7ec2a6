//! A YAML document as a tree of located nodes. PURE.
//!
//! serde stops at the first error; operators want every problem in a file at once, each
//! with its line. So the file is first read into this generic tree (every node carries the
//! line and column it came from) and then converted field by field in [`super::parse`],
//! which collects all problems instead of stopping.

use serde::de::{self, Deserialize, Deserializer, MapAccess, SeqAccess, Visitor};
use serde_saphyr::Spanned;
use std::fmt;

/// Line and column (1-based) of a node in the source.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Default)]
pub struct Pos {
    pub line: u32,
    pub col: u32,
}

/// One YAML node with its position.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Node {
    pub pos: Pos,
    pub value: Value,
}

/// The value of a node. Mappings keep source order and key positions.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Value {
    Null,
    Bool(bool),
    Int(i128),
    Float(f64),
    Str(String),
    Seq(Vec<Node>),
    Map(Vec<(Key, Node)>),
}

/// A mapping key and its position.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Key {
    pub pos: Pos,
    pub name: String,
}

impl Value {
    /// What the node is, for "expected X, found Y" messages.
    pub(crate) fn kind(&self) -> &'static str {
        match self {
            Value::Null => "null",
            Value::Bool(_) => "a boolean",
            Value::Int(_) => "an integer",
            Value::Float(_) => "a number",
            Value::Str(_) => "a string",
            Value::Seq(_) => "a list",
            Value::Map(_) => "a mapping",
        }
    }
}

fn pos_of<T>(s: &Spanned<T>) -> Pos {
    Pos {
        line: s.referenced.line() as u32,
        col: s.referenced.column() as u32,
    }
}

/// Raw tree as serde-saphyr hands it over; converted into [`Node`] right after.
struct RawValue(Value);

impl<'de> Deserialize<'de> for RawValue {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(RawVisitor).map(RawValue)
    }
}

struct RawVisitor;

impl<'de> Visitor<'de> for RawVisitor {
    type Value = Value;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("any YAML value")
    }
    fn visit_unit<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }
    fn visit_none<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }
    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Value, D::Error> {
        RawValue::deserialize(d).map(|r| r.0)
    }
    fn visit_bool<E>(self, v: bool) -> Result<Value, E> {
        Ok(Value::Bool(v))
    }
    fn visit_i64<E>(self, v: i64) -> Result<Value, E> {
        Ok(Value::Int(v.into()))
    }
    fn visit_u64<E>(self, v: u64) -> Result<Value, E> {
        Ok(Value::Int(v.into()))
    }
    fn visit_i128<E>(self, v: i128) -> Result<Value, E> {
        Ok(Value::Int(v))
    }
    fn visit_u128<E: de::Error>(self, v: u128) -> Result<Value, E> {
        i128::try_from(v)
            .map(Value::Int)
            .map_err(|_| E::custom("integer out of range"))
    }
    fn visit_f64<E>(self, v: f64) -> Result<Value, E> {
        Ok(Value::Float(v))
    }
    fn visit_str<E>(self, v: &str) -> Result<Value, E> {
        Ok(Value::Str(v.to_owned()))
    }
    fn visit_string<E>(self, v: String) -> Result<Value, E> {
        Ok(Value::Str(v))
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut a: A) -> Result<Value, A::Error> {
        let mut items = Vec::new();
        while let Some(item) = a.next_element::<Spanned<RawValue>>()? {
            items.push(Node {
                pos: pos_of(&item),
                value: item.value.0,
            });
        }
        Ok(Value::Seq(items))
    }
    fn visit_map<A: MapAccess<'de>>(self, mut a: A) -> Result<Value, A::Error> {
        let mut entries = Vec::new();
        while let Some(k) = a.next_key::<Spanned<RawValue>>()? {
            let v = a.next_value::<Spanned<RawValue>>()?;
            let name = match &k.value.0 {
                Value::Str(s) => s.clone(),
                Value::Int(i) => i.to_string(),
                Value::Bool(b) => b.to_string(),
                other => return Err(de::Error::custom(format!("{} as a key", other.kind()))),
            };
            entries.push((
                Key {
                    pos: pos_of(&k),
                    name,
                },
                Node {
                    pos: pos_of(&v),
                    value: v.value.0,
                },
            ));
        }
        Ok(Value::Map(entries))
    }
}

/// A YAML syntax error with its position.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct SyntaxError {
    pub pos: Pos,
    pub message: String,
}

/// Parse `text` into a located tree. An empty document is an empty mapping.
pub(crate) fn parse(text: &str) -> Result<Node, SyntaxError> {
    if text.trim().is_empty() {
        return Ok(Node {
            pos: Pos { line: 1, col: 1 },
            value: Value::Map(Vec::new()),
        });
    }
    let options = serde_saphyr::options! { with_snippet: false };
    match serde_saphyr::from_str_with_options::<Spanned<RawValue>>(text, options) {
        Ok(root) => Ok(Node {
            pos: pos_of(&root),
            value: root.value.0,
        }),
        Err(e) => {
            let pos = e.location().map_or(Pos { line: 1, col: 1 }, |l| Pos {
                line: l.line() as u32,
                col: l.column() as u32,
            });
            Err(SyntaxError {
                pos,
                message: clean_message(&e.to_string()),
            })
        }
    }
}

/// serde-saphyr prefixes messages with "error: line L column C: "; the position is
/// printed separately, so keep only the problem.
fn clean_message(msg: &str) -> String {
    let first = msg.lines().next().unwrap_or(msg);
    let first = first.strip_prefix("error: ").unwrap_or(first);
    let rest = match first.find(": ") {
        Some(i) if first[..i].starts_with("line ") => &first[i + 2..],
        _ => first,
    };
    // serde-saphyr also appends " at line L column C" on some messages.
    let rest = match rest.rfind(" at line ") {
        Some(i) => &rest[..i],
        None => rest,
    };
    rest.trim().to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_positions_and_types() {
        let n = parse("a: 1\nb:\n  - x\n  - 2.5\nc: null\n").expect("valid");
        let Value::Map(m) = n.value else {
            panic!("not a map")
        };
        assert_eq!(m[0].0.name, "a");
        assert_eq!(m[0].1.value, Value::Int(1));
        assert_eq!(m[0].1.pos, Pos { line: 1, col: 4 });
        let Value::Seq(s) = &m[1].1.value else {
            panic!("not a seq")
        };
        assert_eq!(s[1].pos.line, 4);
        assert_eq!(s[1].value, Value::Float(2.5));
        assert_eq!(m[2].1.value, Value::Null);
    }

    #[test]
    fn syntax_error_has_position_and_short_message() {
        let e = parse("a: [1,\n b: 2").expect_err("invalid");
        assert_eq!(e.pos.line, 1);
        assert!(!e.message.contains('\n'));
        let e = parse("a: 1\na: 2\n").expect_err("duplicate");
        assert_eq!(e.pos.line, 2);
        assert!(e.message.contains("duplicate"), "{}", e.message);
    }

    #[test]
    fn empty_is_empty_map() {
        assert_eq!(parse("  \n").expect("ok").value, Value::Map(vec![]));
    }
}
