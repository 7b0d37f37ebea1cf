//! The batch sweep at start: a model whose batches past 4 rows cost far more per row makes
//! the service close its batches at 4.

mod common;

use std::time::Duration;

use common::{config, http, job};
use warpdrive::Result;
use warpdrive_serve::{Model, ServeConfig, Server};

/// 2 ms a batch up to 4 rows, 4 ms a row past that (so 4 rows is the best by 8×).
struct Knee;

impl Model for Knee {
    fn name(&self) -> &str {
        "knee"
    }
    fn width(&self) -> usize {
        1
    }
    fn run(&mut self, input: &[f32], output: &mut Vec<f32>) -> Result<()> {
        let rows = input.len() as u32;
        let cost = if rows <= 4 {
            Duration::from_millis(2)
        } else {
            Duration::from_millis(4) * rows
        };
        std::thread::sleep(cost);
        output.clear();
        output.extend_from_slice(input);
        Ok(())
    }
}

#[test]
fn the_sweep_at_start_caps_batches_at_the_best_size() {
    let server = Server::start(
        || Ok(Box::new(Knee)),
        ServeConfig {
            tune_batch: true,
            max_batch_rows: 16,
            ..config()
        },
    )
    .unwrap();
    let s = server.status();
    assert_eq!((s.tuned_best, s.batch_rows), (Some(4), 4), "{s:?}");
    assert!(s.tuned_knee.is_some_and(|k| k <= 4), "{s:?}");
    let (status, body) = http(server.addr, "POST", "/v1/jobs", &job(1, &[1.0]));
    assert_eq!(status, 200, "{body}");
}
