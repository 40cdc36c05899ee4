//! Rate-limit response header fields, formatted from the limits a request met.
//!
//! Three generations, each switchable in the node config:
//! - IETF draft-ietf-httpapi-ratelimit-headers-10: `RateLimit-Policy: "name";q=100;w=60`
//!   and `RateLimit: "name";r=50;t=30`, one item per limit (Structured Field lists);
//! - the older single-limit `RateLimit-Limit`, `RateLimit-Remaining`, `RateLimit-Reset`
//!   (plain integers, as envoyproxy/ratelimit emits them), from the most restrictive limit;
//! - `Retry-After` in seconds on an over-limit answer.
//!
//! Pure formatting: the RLS service (`crate::api::rls`) gathers the numbers.

/// One limit as the client should see it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LimitReport {
    /// Stable policy name (the rule's `name`, or its path).
    pub policy_name: String,
    /// Quota per window (`q`).
    pub quota: u64,
    /// Window length in ms (`w`, sent as whole seconds, at least 1).
    pub window_ms: u64,
    /// Hits left (`r`).
    pub remaining: u64,
    /// Milliseconds until the limit has fully reset (`t`, sent as whole seconds, rounded up).
    pub reset_ms: u64,
}

/// Which header generations to emit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HeaderOptions {
    /// `RateLimit-Policy` and `RateLimit`.
    pub ietf_draft10: bool,
    /// `RateLimit-Limit`, `RateLimit-Remaining`, `RateLimit-Reset`.
    pub legacy: bool,
    /// `Retry-After` when over the limit.
    pub retry_after: bool,
}

/// Formats the header fields for the given limits; `retry_after_ms` is set when the
/// request is over the limit. Returns `(name, value)` pairs; empty when `reports` is.
pub fn format_headers(
    reports: &[LimitReport],
    retry_after_ms: Option<u64>,
    options: HeaderOptions,
) -> Vec<(&'static str, String)> {
    let mut headers = Vec::new();
    if reports.is_empty() {
        return headers;
    }
    if options.ietf_draft10 {
        let mut policies = Vec::with_capacity(reports.len());
        let mut states = Vec::with_capacity(reports.len());
        let mut seen: Vec<&str> = Vec::with_capacity(reports.len());
        for report in reports {
            // One item per policy name: a rule met by two descriptors is one policy.
            if seen.contains(&report.policy_name.as_str()) {
                continue;
            }
            seen.push(&report.policy_name);
            let name = structured_string(&report.policy_name);
            policies.push(format!(
                "{name};q={};w={}",
                report.quota,
                window_seconds(report.window_ms)
            ));
            states.push(format!(
                "{name};r={};t={}",
                report.remaining,
                ceil_seconds(report.reset_ms)
            ));
        }
        headers.push(("ratelimit-policy", policies.join(", ")));
        headers.push(("ratelimit", states.join(", ")));
    }
    if options.legacy {
        let tightest = reports
            .iter()
            .min_by(|a, b| a.remaining.cmp(&b.remaining).then(b.reset_ms.cmp(&a.reset_ms)))
            .expect("reports is not empty");
        headers.push(("ratelimit-limit", tightest.quota.to_string()));
        headers.push(("ratelimit-remaining", tightest.remaining.to_string()));
        headers.push(("ratelimit-reset", ceil_seconds(tightest.reset_ms).to_string()));
    }
    if options.retry_after {
        if let Some(retry_after_ms) = retry_after_ms {
            headers.push(("retry-after", ceil_seconds(retry_after_ms).max(1).to_string()));
        }
    }
    headers
}

/// Whole seconds, rounded up: a client that waits this long is never early.
pub fn ceil_seconds(ms: u64) -> u64 {
    ms / 1000 + u64::from(ms % 1000 != 0)
}

/// The draft forbids sub-second and zero windows: at least one second.
fn window_seconds(window_ms: u64) -> u64 {
    ceil_seconds(window_ms).max(1)
}

/// A Structured Field String (RFC 9651 section 3.3.3): printable ASCII, with `"` and `\`
/// escaped; any other byte becomes `_` so the field always parses.
fn structured_string(text: &str) -> String {
    let mut out = String::with_capacity(text.len() + 2);
    out.push('"');
    for character in text.chars() {
        match character {
            '"' | '\\' => {
                out.push('\\');
                out.push(character);
            }
            ' '..='~' => out.push(character),
            _ => out.push('_'),
        }
    }
    out.push('"');
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const ALL: HeaderOptions =
        HeaderOptions { ietf_draft10: true, legacy: true, retry_after: true };

    fn report(
        name: &str,
        quota: u64,
        window_ms: u64,
        remaining: u64,
        reset_ms: u64,
    ) -> LimitReport {
        LimitReport { policy_name: name.to_owned(), quota, window_ms, remaining, reset_ms }
    }

    fn header<'h>(headers: &'h [(&'static str, String)], name: &str) -> Option<&'h str> {
        headers.iter().find(|(key, _)| *key == name).map(|(_, value)| value.as_str())
    }

    /// Two limits give two draft-10 items each, and the legacy fields follow the tighter one.
    #[test]
    fn two_limits_format_as_draft10_lists() {
        let reports =
            [report("burst", 100, 60_000, 50, 30_000), report("daily", 1000, 86_400_000, 999, 10)];
        let headers = format_headers(&reports, None, ALL);
        assert_eq!(
            header(&headers, "ratelimit-policy"),
            Some("\"burst\";q=100;w=60, \"daily\";q=1000;w=86400")
        );
        assert_eq!(header(&headers, "ratelimit"), Some("\"burst\";r=50;t=30, \"daily\";r=999;t=1"));
        assert_eq!(header(&headers, "ratelimit-limit"), Some("100"));
        assert_eq!(header(&headers, "ratelimit-remaining"), Some("50"));
        assert_eq!(header(&headers, "ratelimit-reset"), Some("30"));
        assert_eq!(header(&headers, "retry-after"), None);
    }

    /// Retry-After rounds up and is at least one second; sub-second windows say w=1.
    #[test]
    fn retry_after_rounds_up() {
        let reports = [report("per-ip", 10, 500, 0, 1)];
        let headers = format_headers(&reports, Some(1_001), ALL);
        assert_eq!(header(&headers, "retry-after"), Some("2"));
        assert_eq!(header(&headers, "ratelimit-policy"), Some("\"per-ip\";q=10;w=1"));
        let headers = format_headers(&reports, Some(0), ALL);
        assert_eq!(header(&headers, "retry-after"), Some("1"));
    }

    /// Disabled generations are not emitted, and no limits means no headers.
    #[test]
    fn options_select_generations() {
        let reports = [report("a", 1, 1000, 1, 0)];
        let only_legacy = HeaderOptions { ietf_draft10: false, legacy: true, retry_after: false };
        let headers = format_headers(&reports, Some(5), only_legacy);
        assert_eq!(headers.len(), 3);
        assert!(header(&headers, "ratelimit").is_none());
        assert!(format_headers(&[], Some(5), ALL).is_empty());
    }

    /// Names with quotes, backslashes or non-ASCII still form a valid Structured String.
    #[test]
    fn names_are_escaped() {
        assert_eq!(structured_string("a\"b\\c d"), "\"a\\\"b\\\\c d\"");
        assert_eq!(structured_string("zé"), "\"z_\"");
    }

    proptest! {
        /// Any name yields a string of printable ASCII whose unescaped form has no bare quote.
        #[test]
        fn structured_strings_are_printable(name in ".{0,40}") {
            let formatted = structured_string(&name);
            prop_assert!(formatted.bytes().all(|byte| (0x20..=0x7e).contains(&byte)));
            let inner = &formatted[1..formatted.len() - 1];
            let mut escaped = false;
            for character in inner.chars() {
                if escaped { escaped = false; continue; }
                if character == '\\' { escaped = true; continue; }
                prop_assert_ne!(character, '"');
            }
            prop_assert!(!escaped);
        }

        /// ceil_seconds never under-reports: seconds * 1000 >= ms and is the smallest such.
        #[test]
        fn ceil_seconds_is_tight(ms in any::<u64>()) {
            let seconds = ceil_seconds(ms);
            prop_assert!(u128::from(seconds) * 1000 >= u128::from(ms));
            prop_assert!(seconds == 0 || u128::from(seconds - 1) * 1000 < u128::from(ms));
        }
    }
}
