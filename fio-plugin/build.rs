//! Compiles the C shim against fio's own headers. fio has no installed headers: the shim needs
//! the configured source tree of the fio that will load the plugin (`FIO_SRC`, set up by
//! `setup.sh`). Without it the library still builds, as an inert placeholder whose
//! `get_ioengine` explains what is missing, so a plain `cargo build` of the workspace works on
//! a machine without the fio sources.

use std::path::PathBuf;

fn main() {
    println!("cargo:rerun-if-env-changed=FIO_SRC");
    println!("cargo:rerun-if-changed=src/shim.c");
    println!("cargo:rustc-check-cfg=cfg(fio_shim)");
    let Some(src) = std::env::var_os("FIO_SRC").map(PathBuf::from) else {
        println!(
            "cargo:warning=FIO_SRC is not set: building an inert fio plugin (run fio-plugin/setup.sh)"
        );
        return;
    };
    let config = src.join("config-host.h");
    if !config.is_file() {
        panic!(
            "FIO_SRC={} has no config-host.h: run ./configure --disable-native there (fio-plugin/setup.sh does)",
            src.display()
        );
    }
    println!("cargo:rerun-if-changed={}", config.display());
    cc::Build::new()
        .file("src/shim.c")
        .include(&src)
        .define("_GNU_SOURCE", None)
        .flag("-include")
        .flag(config.to_str().expect("FIO_SRC must be valid UTF-8"))
        .flag("-fPIC")
        .warnings(false)
        .compile("nvmf_fio_shim");
    println!("cargo:rustc-cfg=fio_shim");
    // fio dlcloses the engine at exit while runtime threads may still be unwinding (SPDK's
    // plugin hit the same race): never unmap the library.
    println!("cargo:rustc-cdylib-link-arg=-Wl,-z,nodelete");
}
