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

/// "1 loan", "2 loans": `n` and the word, singular for exactly one.
pub fn things(n: impl Into<i128>, one: &str, many: &str) -> String {
    let n: i128 = n.into();
    format!("{} {}", count(n), if n == 1 { one } else { many })
}
