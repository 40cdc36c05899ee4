//! Epoch milliseconds as RFC 3339 text in UTC (`2026-12-02T02:31:15.123Z`), for every
//! message and CLI line a person reads: logs, billing history, clock warnings. The wire
//! formats and `--json` output keep the milliseconds, which programs compare.

/// `epoch_ms` (milliseconds since 1970-01-01 UTC) as RFC 3339 with milliseconds, in UTC.
/// Past year 9999 (not a time any clock here reads) the milliseconds are shown as they are.
pub fn format_epoch_ms(epoch_ms: u64) -> String {
    let nanoseconds = i128::from(epoch_ms) * 1_000_000;
    match time::OffsetDateTime::from_unix_timestamp_nanos(nanoseconds) {
        Ok(moment) if moment.year() <= 9999 => format!(
            "{:04}-{:02}-{:02}T{:02}:{:02}:{:02}.{:03}Z",
            moment.year(),
            u8::from(moment.month()),
            moment.day(),
            moment.hour(),
            moment.minute(),
            moment.second(),
            moment.millisecond(),
        ),
        _ => format!("{epoch_ms} ms after the epoch"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Known instants, the epoch and a leap day among them.
    #[test]
    fn known_instants() {
        assert_eq!(format_epoch_ms(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(format_epoch_ms(951_782_400_000), "2000-02-29T00:00:00.000Z");
        assert_eq!(format_epoch_ms(1_796_178_675_123), "2026-12-02T02:31:15.123Z");
        assert_eq!(format_epoch_ms(u64::MAX), format!("{} ms after the epoch", u64::MAX));
    }

    proptest! {
        /// Against a naive model: the text's fields recompute the same milliseconds.
        #[test]
        fn fields_recompute_the_instant(epoch_ms in 0u64..253_402_300_800_000) {
            let text = format_epoch_ms(epoch_ms);
            prop_assert_eq!(text.len(), 24);
            let number = |range: std::ops::Range<usize>| text[range].parse::<i64>().expect("digits");
            let (year, month, day) = (number(0..4), number(5..7), number(8..10));
            // Days from civil (proleptic Gregorian), counted the slow way.
            let leap = |y: i64| (y % 4 == 0 && y % 100 != 0) || y % 400 == 0;
            let days_in_month = [31, 28, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31];
            let mut days: i64 = (1970..year).map(|y| if leap(y) { 366 } else { 365 }).sum();
            for m in 1..month {
                days += days_in_month[usize::try_from(m - 1).expect("month")] + i64::from(m == 2 && leap(year));
            }
            days += day - 1;
            let milliseconds = ((days * 24 + number(11..13)) * 60 + number(14..16)) * 60_000
                + number(17..19) * 1000
                + number(20..23);
            prop_assert_eq!(u64::try_from(milliseconds).expect("positive"), epoch_ms);
        }
    }
}
