//! The `fulcrum simulate` engines, and the routing question of `fulcrum route` and the admin
//! API (`route`): the real selection and slow-start code driven by
//! synthetic keys and simulated time. PURE (the hash engine times its own lookups).

pub mod flow;
pub mod hash;
pub mod route;
pub mod slow_start;
