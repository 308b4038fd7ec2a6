//! SIP message capture to a HEP collector (Homer, sngrep, Kamailio's sipcapture):
//! `hep` writes the packets (PURE).
pub mod hep;
