//! The running gateway process: its wiring, signals and binary upgrade (`app`), the live state swapped on reload and
//! discovery (`live`), and what it reports (`metrics`, `logging`).

pub mod app;
pub mod live;
pub mod logging;
pub mod metrics;
