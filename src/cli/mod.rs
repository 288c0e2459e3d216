//! What only the command line uses: `oipgate demo` and `oipgate convert`.

pub mod convert;
pub mod demo;
