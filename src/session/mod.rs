//! Flow state of the generic data paths.
//!
//! - `table`  PURE  bounded UDP session table with idle expiry (`now` passed in)

pub(crate) mod table;

pub(crate) use table::{Admit, Session, SessionId, SessionKey, SessionTable};
