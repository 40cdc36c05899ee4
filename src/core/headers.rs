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

use std::fmt::Write;

use smallvec::SmallVec;

/// What a limit's header fields say that no answer changes: its policy name, quoted, and
/// its `RateLimit-Policy` item. Formatted once, when the policy loads (or a request's own
/// limit is read), so an answer copies them instead of formatting them again.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PolicyHeader {
    /// The policy name as a Structured Field String: `"name"`.
    quoted_name: String,
    /// `"name";q=100;w=60`.
    policy_item: String,
    /// Quota per window (`q`), the legacy `RateLimit-Limit`.
    quota: u64,
    /// The window in whole seconds, at least 1 (`w`).
    window_s: u64,
}

impl PolicyHeader {
    /// The fields of a limit of `quota` per `window_ms` (`w`, whole seconds, at least 1),
    /// under the policy name `name`.
    pub fn new(name: &str, quota: u64, window_ms: u64) -> Self {
        let mut quoted_name = String::with_capacity(name.len() + 2);
        push_structured_string(&mut quoted_name, name);
        Self::formatted(quoted_name, quota, window_seconds(window_ms))
    }

    /// The same policy with a quota of `quota` (a region's slice of a limit moved).
    #[must_use]
    pub fn with_quota(&self, quota: u64) -> Self {
        Self::formatted(self.quoted_name.clone(), quota, self.window_s)
    }

    fn formatted(quoted_name: String, quota: u64, window_s: u64) -> Self {
        let mut policy_item = quoted_name.clone();
        push_parameter(&mut policy_item, ";q=", quota);
        push_parameter(&mut policy_item, ";w=", window_s);
        Self { quoted_name, policy_item, quota, window_s }
    }
}

/// One limit as the client should see it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LimitReport<'n> {
    /// The limit's fixed part.
    pub policy: &'n PolicyHeader,
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

/// What an answer's header fields usually take: two policies' draft-10 fields and a
/// `Retry-After`.
const FIELDS_BYTES_USUAL: usize = 128;

/// An answer's header fields, their values written one after another into one string: the
/// fields of an answer cost one allocation, not two each, on every answer.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HeaderFields {
    text: String,
    /// Each field's name and the end of its value in `text` (it starts where the last ended).
    ends: SmallVec<[(&'static str, usize); 4]>,
}

impl HeaderFields {
    /// Adds the field `name` whose value `write` appends.
    pub fn push_with(&mut self, name: &'static str, write: impl FnOnce(&mut String)) {
        if self.text.capacity() == 0 {
            // Room for an answer's usual fields at once, not grown a few bytes at a time.
            self.text.reserve(FIELDS_BYTES_USUAL);
        }
        write(&mut self.text);
        self.ends.push((name, self.text.len()));
    }

    /// The fields in the order they were added: `(name, value)`.
    pub fn iter(&self) -> impl ExactSizeIterator<Item = (&'static str, &str)> + '_ {
        let mut start = 0;
        self.ends.iter().map(move |&(name, end)| {
            let value = &self.text[start..end];
            start = end;
            (name, value)
        })
    }
}

/// Writes the header fields for the given limits into `fields` (none when `reports` is
/// empty). `retry_after_ms` is set when the request is over the limit.
pub fn emit_headers(
    reports: &[LimitReport<'_>],
    retry_after_ms: Option<u64>,
    options: HeaderOptions,
    fields: &mut HeaderFields,
) {
    if reports.is_empty() {
        return;
    }
    if options.ietf_draft10 {
        fields.push_with("ratelimit-policy", |out| {
            push_items(out, reports, |out, report| out.push_str(&report.policy.policy_item));
        });
        fields.push_with("ratelimit", |out| {
            push_items(out, reports, |out, report| {
                out.push_str(&report.policy.quoted_name);
                push_parameter(out, ";r=", report.remaining);
                push_parameter(out, ";t=", ceil_seconds(report.reset_ms));
            });
        });
    }
    if options.legacy {
        let tightest = reports
            .iter()
            .min_by(|a, b| a.remaining.cmp(&b.remaining).then(b.reset_ms.cmp(&a.reset_ms)))
            .expect("reports is not empty");
        fields.push_with("ratelimit-limit", |out| push_integer(out, tightest.policy.quota));
        fields.push_with("ratelimit-remaining", |out| push_integer(out, tightest.remaining));
        fields
            .push_with("ratelimit-reset", |out| push_integer(out, ceil_seconds(tightest.reset_ms)));
    }
    if let (true, Some(retry_after_ms)) = (options.retry_after, retry_after_ms) {
        fields.push_with("retry-after", |out| {
            push_integer(out, ceil_seconds(retry_after_ms).max(1));
        });
    }
}

/// A caller a warn-stage rule would have refused (DESIGN section 7): how far over its limit
/// it is, and when enforcement begins.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Warning<'d> {
    /// How far the caller's traffic is over the limit, in thousandths of it
    /// (`crate::core::admission::over_limit_permille`); `None` when that is not known (a
    /// limit of 0, or traffic not yet above the limit's rate: a burst).
    pub over_permille: Option<u64>,
    /// The rule's `enforce_after` day, `YYYY-MM-DD`.
    pub enforce_after: Option<&'d str>,
}

impl Warning<'_> {
    /// The warning of a request that met several warned rules: the furthest over, and the
    /// earliest enforcement.
    #[must_use]
    pub fn merge(self, other: Self) -> Self {
        Warning {
            over_permille: self.over_permille.max(other.over_permille),
            enforce_after: match (self.enforce_after, other.enforce_after) {
                (Some(mine), Some(theirs)) => Some(mine.min(theirs)),
                (mine, theirs) => mine.or(theirs),
            },
        }
    }
}

/// Appends the `RateLimit-Warning` field of a warned request: `20% over quota; enforcement begins
/// 2027-01-08` (`over quota` when how far is not known; `not enforced yet` without a day).
/// Percentages round to the nearest whole one, and never show an over-limit caller as 0 %.
pub fn push_warning(value: &mut String, warning: Warning<'_>) {
    match warning.over_permille.filter(|permille| *permille > 0) {
        Some(permille) => {
            let percent = permille.saturating_add(5) / 10;
            let _ = write!(value, "{}% over quota", percent.max(1));
        }
        None => value.push_str("over quota"),
    }
    match warning.enforce_after {
        Some(day) => {
            let _ = write!(value, "; enforcement begins {day}");
        }
        None => value.push_str("; not enforced yet"),
    }
}

/// Appends a draft-10 list: one item per policy name (a rule met by two descriptors is one
/// policy), each what `push_item` appends.
fn push_items(
    out: &mut String,
    reports: &[LimitReport<'_>],
    push_item: impl Fn(&mut String, &LimitReport<'_>),
) {
    for (index, report) in reports.iter().enumerate() {
        let quoted_name = &report.policy.quoted_name;
        if reports[..index].iter().any(|earlier| earlier.policy.quoted_name == *quoted_name) {
            continue;
        }
        if index > 0 {
            out.push_str(", ");
        }
        push_item(out, report);
    }
}

/// Whole seconds, rounded up: a client that waits this long is never early.
pub fn ceil_seconds(ms: u64) -> u64 {
    ms.div_ceil(1000)
}

/// Appends `name` and `value` (a Structured Field parameter such as `;q=100`); `itoa`
/// writes the digits without the formatting machinery, on every answer.
fn push_parameter(out: &mut String, name: &str, value: u64) {
    out.push_str(name);
    out.push_str(itoa::Buffer::new().format(value));
}

/// Appends a header value of one integer.
fn push_integer(out: &mut String, value: u64) {
    out.push_str(itoa::Buffer::new().format(value));
}

/// The draft forbids sub-second and zero windows: at least one second.
fn window_seconds(window_ms: u64) -> u64 {
    ceil_seconds(window_ms).max(1)
}

/// Appends a Structured Field String (RFC 9651 section 3.3.3): printable ASCII, with `"` and
/// `\` escaped; any other character becomes `_` so the field always parses.
fn push_structured_string(out: &mut String, text: &str) {
    out.push('"');
    // Names are almost always plain: copied whole, not character by character.
    if text.bytes().all(|byte| matches!(byte, b' '..=b'~') && byte != b'"' && byte != b'\\') {
        out.push_str(text);
        out.push('"');
        return;
    }
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
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn format_headers(
        reports: &[LimitReport<'_>],
        retry_after_ms: Option<u64>,
        options: HeaderOptions,
    ) -> Vec<(&'static str, String)> {
        let mut fields = HeaderFields::default();
        emit_headers(reports, retry_after_ms, options, &mut fields);
        fields.iter().map(|(name, value)| (name, value.to_owned())).collect()
    }

    fn format_warning(warning: Warning<'_>) -> String {
        let mut value = String::new();
        push_warning(&mut value, warning);
        value
    }

    fn structured_string(text: &str) -> String {
        let mut out = String::new();
        push_structured_string(&mut out, text);
        out
    }

    const ALL: HeaderOptions =
        HeaderOptions { ietf_draft10: true, legacy: true, retry_after: true };

    fn report(policy: &PolicyHeader, remaining: u64, reset_ms: u64) -> LimitReport<'_> {
        LimitReport { policy, remaining, reset_ms }
    }

    /// The warning says how far over and when, rounds to whole percents without ever
    /// saying 0 %, and merges to the furthest over and the earliest day.
    #[test]
    fn a_warning_says_how_far_over_and_when() {
        let warning = |over_permille, enforce_after| Warning { over_permille, enforce_after };
        assert_eq!(
            format_warning(warning(Some(200), Some("2027-01-08"))),
            "20% over quota; enforcement begins 2027-01-08"
        );
        assert_eq!(format_warning(warning(Some(2), None)), "1% over quota; not enforced yet");
        assert_eq!(format_warning(warning(Some(1_254), None)), "125% over quota; not enforced yet");
        assert_eq!(format_warning(warning(Some(0), None)), "over quota; not enforced yet");
        assert_eq!(
            format_warning(warning(None, Some("2027-02-01"))),
            "over quota; enforcement begins 2027-02-01"
        );
        assert_eq!(
            warning(Some(300), Some("2027-03-01")).merge(warning(Some(50), Some("2027-01-08"))),
            warning(Some(300), Some("2027-01-08"))
        );
        assert_eq!(
            warning(None, None).merge(warning(Some(50), Some("2027-01-08"))),
            warning(Some(50), Some("2027-01-08"))
        );
    }

    fn header<'h>(headers: &'h [(&'static str, String)], name: &str) -> Option<&'h str> {
        headers.iter().find(|(key, _)| *key == name).map(|(_, value)| value.as_str())
    }

    /// Two limits give two draft-10 items each, and the legacy fields follow the tighter one.
    #[test]
    fn two_limits_format_as_draft10_lists() {
        let (burst, daily) =
            (PolicyHeader::new("burst", 100, 60_000), PolicyHeader::new("daily", 1000, 86_400_000));
        let reports = [report(&burst, 50, 30_000), report(&daily, 999, 10)];
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

    /// A rule met by two descriptors is one policy: its name is listed once, in the order
    /// first met, and the fields after it read back whole from the shared string.
    #[test]
    fn a_policy_met_twice_is_listed_once() {
        let (per_ip, burst) =
            (PolicyHeader::new("per-ip", 10, 1_000), PolicyHeader::new("burst", 100, 60_000));
        let reports =
            [report(&per_ip, 9, 1_000), report(&burst, 50, 30_000), report(&per_ip, 3, 1_000)];
        let headers = format_headers(&reports, Some(1_500), ALL);
        assert_eq!(
            header(&headers, "ratelimit-policy"),
            Some("\"per-ip\";q=10;w=1, \"burst\";q=100;w=60")
        );
        assert_eq!(header(&headers, "ratelimit"), Some("\"per-ip\";r=9;t=1, \"burst\";r=50;t=30"));
        assert_eq!(header(&headers, "ratelimit-remaining"), Some("3"));
        assert_eq!(header(&headers, "retry-after"), Some("2"));
        assert_eq!(headers.len(), 6);
    }

    /// A moved region slice changes the quota and keeps the name and window.
    #[test]
    fn a_new_quota_keeps_the_name_and_window() {
        let policy = PolicyHeader::new("per \"ip\"", 10, 60_000);
        let sliced = policy.with_quota(4);
        assert_eq!(sliced, PolicyHeader::new("per \"ip\"", 4, 60_000));
        let reports = [report(&sliced, 3, 0)];
        let headers = format_headers(&reports, None, ALL);
        assert_eq!(header(&headers, "ratelimit-policy"), Some("\"per \\\"ip\\\"\";q=4;w=60"));
        assert_eq!(header(&headers, "ratelimit-limit"), Some("4"));
    }

    /// Retry-After rounds up and is at least one second; sub-second windows say w=1.
    #[test]
    fn retry_after_rounds_up() {
        let per_ip = PolicyHeader::new("per-ip", 10, 500);
        let reports = [report(&per_ip, 0, 1)];
        let headers = format_headers(&reports, Some(1_001), ALL);
        assert_eq!(header(&headers, "retry-after"), Some("2"));
        assert_eq!(header(&headers, "ratelimit-policy"), Some("\"per-ip\";q=10;w=1"));
        let headers = format_headers(&reports, Some(0), ALL);
        assert_eq!(header(&headers, "retry-after"), Some("1"));
    }

    /// Disabled generations are not emitted, and no limits means no headers.
    #[test]
    fn options_select_generations() {
        let policy = PolicyHeader::new("a", 1, 1000);
        let reports = [report(&policy, 1, 0)];
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

        /// The whole-name copy of a plain name and the character-by-character escaping agree:
        /// a name is copied whole exactly when escaping would change nothing.
        #[test]
        fn plain_names_are_copied_as_escaping_would(name in "[ -~]{0,20}|[a-z\"\\\\é]{0,8}") {
            let escaped: String = name
                .chars()
                .flat_map(|character| match character {
                    '"' | '\\' => vec!['\\', character],
                    ' '..='~' => vec![character],
                    _ => vec!['_'],
                })
                .collect();
            prop_assert_eq!(structured_string(&name), format!("\"{escaped}\""));
        }

        /// Parameters and integer fields print every value as `to_string` does.
        #[test]
        fn integers_print_as_decimal(value in any::<u64>()) {
            let mut parameter = String::new();
            push_parameter(&mut parameter, ";q=", value);
            prop_assert_eq!(parameter, format!(";q={value}"));
            let mut integer = String::new();
            push_integer(&mut integer, value);
            prop_assert_eq!(integer, value.to_string());
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
