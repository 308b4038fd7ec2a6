//! The `fulcrum simulate slow-start` scenario parser, and the simulation of small scenarios
//! (at most 20,000 simulated requests, so one run stays in milliseconds): nothing may panic.
#![no_main]

use fulcrum::simulate::slow_start::{check_scenario, render_json, render_table, run_scenario};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(requests) = check_scenario(text)
        && requests <= 20_000
    {
        let r = run_scenario(text).expect("a scenario that checks runs");
        let _ = render_table(&r);
        let _ = render_json(&r);
    }
});
