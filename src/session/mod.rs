//! Flow state of the generic data paths.
//!
//! - `table`  PURE  bounded UDP session table with idle expiry (`now` passed in)

pub mod table;

pub use table::{Admit, Session, SessionId, SessionKey, SessionTable};
