//! Human-readable durations and sizes.

use std::time::Duration;

pub(crate) fn ms(d: Duration) -> String {
    format!("{:.1} ms", d.as_secs_f64() * 1e3)
}

/// 2 s, 500 ms, 1.5 s, 250 us.
pub(crate) fn human_dur(d: Duration) -> String {
    if d >= Duration::from_secs(1) {
        let s = d.as_secs_f64();
        if s.fract() == 0.0 {
            format!("{s:.0} s")
        } else {
            format!("{s:.2} s")
        }
    } else if d >= Duration::from_millis(1) {
        format!("{} ms", d.as_millis())
    } else {
        format!("{} us", d.as_micros())
    }
}

/// 1.5 GiB, 388.2 MiB, 12.0 KiB.
pub(crate) fn human_bytes(b: u64) -> String {
    let f = b as f64;
    if f >= (1u64 << 30) as f64 {
        format!("{:.2} GiB", f / (1u64 << 30) as f64)
    } else if f >= (1u64 << 20) as f64 {
        format!("{:.1} MiB", f / (1u64 << 20) as f64)
    } else {
        format!("{:.1} KiB", f / 1024.0)
    }
}
