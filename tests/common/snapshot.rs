//! Checked-in snapshots under `tests/snapshots`: a text the code generates (a transition
//! table, its graph) compared with the reviewed copy. `UPDATE_SNAPSHOTS=1` writes the copy
//! instead; review the diff before committing it.

use std::path::PathBuf;

fn snapshot_path(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/snapshots")
        .join(name)
}

pub fn check_snapshot(name: &str, actual: &str) {
    let path = snapshot_path(name);
    if std::env::var_os("UPDATE_SNAPSHOTS").is_some() {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, actual).unwrap();
        return;
    }
    let expected = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{}: {e} (UPDATE_SNAPSHOTS=1 writes it)", path.display()));
    assert!(
        expected == actual,
        "{name} differs from the checked-in snapshot.\n--- expected\n{expected}\n--- actual\n{actual}\n\
         If the change is intended: UPDATE_SNAPSHOTS=1 cargo test --test {}",
        env!("CARGO_CRATE_NAME")
    );
}
