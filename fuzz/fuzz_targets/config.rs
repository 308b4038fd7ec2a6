//! The YAML config loader and what `fulcrum check` and a reload do with a valid file: any
//! text gives a config or a list of located problems, never a panic; a valid config
//! summarises, plans a reload against itself (no change) and builds every vserver's balancer.
#![no_main]

use fulcrum::balancer::Balancer;
use fulcrum::config;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    match config::from_str("fuzz.yaml", text) {
        Ok(c) => {
            let _ = config::summary(&c);
            let plan = fulcrum::reload::plan(&c, &c).expect("a config reloads onto itself");
            assert!(plan.rebuild.is_empty(), "{plan:?}");
            for v in &c.vservers {
                let _ = Balancer::new(&c, v);
            }
        }
        Err(e) => {
            let _ = e.to_string();
        }
    }
});
