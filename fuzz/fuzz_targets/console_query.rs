#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| effectively_fuzz::console::run_query(data));
