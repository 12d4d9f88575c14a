#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| effectively_fuzz::config_load::run(data));
