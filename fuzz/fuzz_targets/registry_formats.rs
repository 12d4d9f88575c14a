#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| effectively_fuzz::registry_formats::run(data));
