//! The only reader of system time. Everything below `crate::core` takes `now_ms` as an
//! argument; the node asks this module once per request and passes the number down.

use std::time::{Instant, SystemTime, UNIX_EPOCH};

/// Wall-clock milliseconds since the Unix epoch.
///
/// Wall time, not monotonic time, because fixed and sliding windows are aligned to the
/// epoch so that every node agrees where a window starts. The core tolerates a clock that
/// steps backwards (it treats that as no time elapsed), so no tokens are minted by NTP.
pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|elapsed| u64::try_from(elapsed.as_millis()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}

/// The monotonic clock: never steps, whatever NTP or an operator does to the wall clock. A
/// Raft leader measures the ledger time it stamps with it (`crate::core::ledger_time`).
pub fn monotonic() -> Instant {
    Instant::now()
}

/// Whole milliseconds elapsed since `earlier` on the monotonic clock.
pub fn elapsed_ms(earlier: Instant) -> u64 {
    u64::try_from(earlier.elapsed().as_millis()).unwrap_or(u64::MAX)
}

/// Microseconds since the Unix epoch (0 if the clock is before it): a node process's
/// incarnation, which orders its lease epochs after those of earlier processes.
pub fn now_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|elapsed| u64::try_from(elapsed.as_micros()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}
