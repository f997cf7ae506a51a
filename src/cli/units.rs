//! Sizes and times as people write and read them: size arguments (`4K`, `1.5G`), durations
//! and byte counts for output, and UTC stamps for logs.

use std::time::Duration;

/// Parse "4096", "4K", "128KiB", "64M", "1.5G", "4T": binary units (K = 1024), a decimal
/// number allowed when the result is a whole number of bytes.
pub fn parse_size(s: &str) -> Result<usize, String> {
    const UNITS: &str = "B, K, M, G, T, P (or KiB/KB, MiB/MB, ...; all powers of 1024)";
    let t = s.trim();
    let split = t
        .find(|c: char| !c.is_ascii_digit() && c != '.')
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let shift = match unit.to_ascii_uppercase().as_str() {
        "" | "B" => 0,
        "K" | "KB" | "KIB" => 10,
        "M" | "MB" | "MIB" => 20,
        "G" | "GB" | "GIB" => 30,
        "T" | "TB" | "TIB" => 40,
        "P" | "PB" | "PIB" => 50,
        _ => return Err(format!("unknown size unit '{unit}' in '{s}': use {UNITS}")),
    };
    let not_a_size = || format!("'{s}' is not a size (try 4096, 128K, 1.5M, 4T)");
    let (whole, frac) = num.split_once('.').unwrap_or((num, ""));
    if whole.is_empty() && frac.is_empty() || frac.contains('.') {
        return Err(not_a_size());
    }
    let whole: u128 = if whole.is_empty() {
        0
    } else {
        whole.parse().map_err(|_| not_a_size())?
    };
    // Exact arithmetic: the fraction as digits over 10^len, so "1.5M" is 1572864 and "0.3K"
    // (307.2 bytes) is refused rather than rounded.
    let frac_digits = frac.trim_end_matches('0');
    if frac_digits.len() > 18 {
        return Err(not_a_size());
    }
    let frac_num: u128 = if frac_digits.is_empty() {
        0
    } else {
        frac_digits.parse().map_err(|_| not_a_size())?
    };
    let denom = 10u128.pow(frac_digits.len() as u32);
    let out_of_range = || format!("size '{s}' out of range");
    let scaled_whole = whole.checked_shl(shift).filter(|v| v >> shift == whole);
    let frac_bytes = frac_num << shift;
    if frac_bytes % denom != 0 {
        return Err(format!(
            "'{s}' is not a whole number of bytes; give it in a smaller unit"
        ));
    }
    scaled_whole
        .and_then(|w| w.checked_add(frac_bytes / denom))
        .and_then(|v| usize::try_from(v).ok())
        .filter(|&v| v > 0)
        .ok_or_else(out_of_range)
}

pub fn ms(d: Duration) -> String {
    format!("{:.1} ms", d.as_secs_f64() * 1e3)
}

/// 2 s, 500 ms, 1.5 s, 250 us.
pub fn human_dur(d: Duration) -> String {
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
pub fn human_bytes(b: u64) -> String {
    let f = b as f64;
    if f >= (1u64 << 30) as f64 {
        format!("{:.2} GiB", f / (1u64 << 30) as f64)
    } else if f >= (1u64 << 20) as f64 {
        format!("{:.1} MiB", f / (1u64 << 20) as f64)
    } else {
        format!("{:.1} KiB", f / 1024.0)
    }
}

/// `t` as UTC in RFC 3339 with milliseconds: 2026-11-27T21:03:18.922Z.
pub fn utc_stamp(t: std::time::SystemTime) -> String {
    let d = t.duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    let secs = d.as_secs();
    let (days, rem) = (secs / 86_400, secs % 86_400);
    // Days since 1970-01-01 to a civil date (H. Hinnant's days_from_civil, inverted).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{:03}Z",
        rem / 3_600,
        rem % 3_600 / 60,
        rem % 60,
        d.subsec_millis()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("128K"), Ok(128 << 10));
        assert_eq!(parse_size("64MiB"), Ok(64 << 20));
        assert_eq!(parse_size("1g"), Ok(1 << 30));
        assert!(parse_size("0").is_err());
        assert!(parse_size("12Q").is_err());
        assert!(parse_size("-1").is_err());
        assert!(parse_size("99999999999999999999G").is_err());
        assert_eq!(parse_size("4T"), Ok(4 << 40));
        assert_eq!(parse_size("1.5M"), Ok(3 << 19));
        assert_eq!(parse_size("0.5K"), Ok(512));
        assert_eq!(parse_size("2.0G"), Ok(2 << 30));
        assert!(parse_size("0.3K")
            .unwrap_err()
            .contains("whole number of bytes"));
        assert!(parse_size("1.2.3M").is_err());
        assert!(parse_size(".").is_err());
        assert!(parse_size("0.0M").is_err());
        let e = parse_size("4X").unwrap_err();
        assert!(
            e.contains("unknown size unit 'X'") && e.contains("K, M, G, T"),
            "{e}"
        );
    }

    #[test]
    fn log_times_are_utc_rfc3339_with_milliseconds() {
        use std::time::UNIX_EPOCH;
        let at = |s: u64, ms: u64| utc_stamp(UNIX_EPOCH + Duration::from_millis(s * 1000 + ms));
        assert_eq!(at(0, 0), "1970-01-01T00:00:00.000Z");
        assert_eq!(at(951_782_400, 0), "2000-02-29T00:00:00.000Z");
        assert_eq!(at(1_795_900_000, 123), "2026-11-28T21:06:40.123Z");
        assert_eq!(at(4_102_444_800, 0), "2100-01-01T00:00:00.000Z");
    }
}
