//! The `fulcrum simulate` engines: the real selection and slow-start code driven by
//! synthetic keys and simulated time. PURE (the hash engine times its own lookups).

pub mod flow;
pub mod hash;
pub mod slow_start;
