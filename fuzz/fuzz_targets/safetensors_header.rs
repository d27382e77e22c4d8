//! Arbitrary bytes as a `.safetensors` file through `checkpoint::read_header`.

#![no_main]

use chunkforge_model::checkpoint;
use chunkforge_fuzz::scratch;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let path = scratch().join("model.safetensors");
    std::fs::write(&path, data).unwrap();
    let _ = checkpoint::read_header(&path);
});
