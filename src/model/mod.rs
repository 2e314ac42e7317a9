//! Models as ordered lists of units, and the parameters they own.

pub mod param;

pub use param::Param;
