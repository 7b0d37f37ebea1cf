//! The results file (`schema: "warpdrive-bench/1"`, see `docs/BENCH.md`): rows, ceilings, the
//! device record, the date, and the plain-text table.

mod ceiling_model;
mod date;
mod schema;
mod table;

pub use ceiling_model::{Ceiling, Ceilings, Metric};
pub use date::{now_rfc3339, rfc3339_utc};
pub use schema::{DeviceRecord, Results, Row, SCHEMA};
pub(crate) use table::{aligned, num, row_key};
pub use table::{format_ceilings, format_table, print_table};

#[cfg(test)]
mod tests;
