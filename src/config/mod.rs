//! Configuration: the model and its YAML loader. PURE.

pub mod model;

pub use model::*;
