//! The `fulcrum simulate` engines: the real selection code driven by simulated time. PURE.

pub mod slow_start;
