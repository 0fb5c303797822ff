//! Numbers as a person writes them, for every surface that shows counts and money to people
//! (the status page, `run --dry-run`).

/// 1234567 → "1,234,567".
pub fn count(n: impl Into<i128>) -> String {
    let n: i128 = n.into();
    let digits = n.unsigned_abs().to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    if n < 0 {
        out.insert(0, '-');
    }
    out
}

/// Cents as money: 1572250 → "15,722.50".
pub fn money(cents: i128) -> String {
    let sign = if cents < 0 { "-" } else { "" };
    let abs = cents.unsigned_abs();
    format!("{sign}{}.{:02}", count((abs / 100) as i128), abs % 100)
}

/// A counted phrase in its two forms: "late return or edit waiting", "late returns or edits
/// waiting". Shown alone it is the plural.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Phrase {
    pub one: &'static str,
    pub many: &'static str,
}

impl Phrase {
    pub const fn new(one: &'static str, many: &'static str) -> Self {
        Self { one, many }
    }

    /// "1 row held", "2 rows held".
    pub fn count(&self, n: impl Into<i128>) -> String {
        things(n, self.one, self.many)
    }
}

impl std::fmt::Display for Phrase {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.many)
    }
}

/// "1 loan", "2 loans": `n` and the word, singular for exactly one.
pub fn things(n: impl Into<i128>, one: &str, many: &str) -> String {
    let n: i128 = n.into();
    format!("{} {}", count(n), if n == 1 { one } else { many })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_money_and_phrases_read_as_a_person_writes_them() {
        assert_eq!(count(0), "0");
        assert_eq!(count(1_234_567), "1,234,567");
        assert_eq!(count(-1_000), "-1,000");
        assert_eq!(money(5_259_800), "52,598.00");
        assert_eq!(money(-4_600), "-46.00");
        assert_eq!(money(7), "0.07");
        assert_eq!(things(1, "loan", "loans"), "1 loan");
        assert_eq!(things(0, "loan", "loans"), "0 loans");
        assert_eq!(things(18_028, "loan", "loans"), "18,028 loans");
        let waiting = Phrase::new(
            "late return or edit waiting",
            "late returns or edits waiting",
        );
        assert_eq!(waiting.count(1), "1 late return or edit waiting");
        assert_eq!(waiting.count(2), "2 late returns or edits waiting");
        assert_eq!(waiting.to_string(), "late returns or edits waiting");
    }
}
