//! `outbox.allowed_streams`: which Redis keys events may be written to. Writers choose a stream
//! (the `stream` argument, or their `aggregate_type` through the `outbox.stream` template), and
//! without a limit a writer could append to any key the relay's Redis user may write, including
//! another system's streams. The setting is a comma-separated list of glob patterns, checked at
//! enqueue so that a refused stream is the writer's error, at once, with nothing inserted.
//!
//! Patterns: `*` matches any run of characters (also none), `?` exactly one character, `\` makes the
//! next character literal; everything else matches itself, case-sensitively (Redis keys are
//! binary-safe byte strings). Spaces around the commas are ignored.

/// Whether `patterns` (the setting's value) allows every stream: the default `*`.
pub fn allows_every_stream(patterns: &str) -> bool {
    split(patterns).any(|pattern| pattern == "*")
}

/// Whether `key` matches one of the comma-separated `patterns`.
pub fn allowed(patterns: &str, key: &str) -> bool {
    split(patterns).any(|pattern| glob_match(pattern, key))
}

/// Checks the setting's syntax: a pattern may not be empty or end with a lone `\`.
pub fn validate(patterns: &str) -> Result<(), String> {
    for (index, pattern) in patterns.split(',').map(str::trim).enumerate() {
        if pattern.is_empty() {
            return Err(format!("pattern {} is empty (a stray comma?)", index + 1));
        }
        let escapes_at_end = pattern.chars().rev().take_while(|&c| c == '\\').count();
        if escapes_at_end % 2 == 1 {
            return Err(format!("pattern \"{pattern}\" ends with a lone \\"));
        }
    }
    Ok(())
}

/// A key as shown in an error message: at most 100 characters.
pub fn shown(key: &str) -> String {
    match key.char_indices().nth(100) {
        Some((cut, _)) => format!("{}...", &key[..cut]),
        None => key.to_string(),
    }
}

fn split(patterns: &str) -> impl Iterator<Item = &str> {
    patterns.split(',').map(str::trim).filter(|pattern| !pattern.is_empty())
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Token {
    Literal(char),
    AnyOne,
    AnyRun,
}

fn tokens(pattern: &str) -> Vec<Token> {
    let mut tokens = Vec::with_capacity(pattern.len());
    let mut chars = pattern.chars();
    while let Some(c) = chars.next() {
        tokens.push(match c {
            '*' => Token::AnyRun,
            '?' => Token::AnyOne,
            '\\' => Token::Literal(chars.next().unwrap_or('\\')),
            other => Token::Literal(other),
        });
    }
    tokens
}

/// Iterative glob matching with backtracking to the last `*`: linear in practice, never
/// exponential, whatever the pattern (a writer chooses the key, an operator the pattern).
fn glob_match(pattern: &str, key: &str) -> bool {
    let tokens = tokens(pattern);
    let text: Vec<char> = key.chars().collect();
    let (mut t, mut k) = (0, 0);
    let mut star: Option<(usize, usize)> = None;
    while k < text.len() {
        match tokens.get(t) {
            Some(Token::AnyRun) => {
                star = Some((t, k));
                t += 1;
            }
            Some(Token::AnyOne) => {
                t += 1;
                k += 1;
            }
            Some(Token::Literal(c)) if *c == text[k] => {
                t += 1;
                k += 1;
            }
            _ => match star {
                // Let the last `*` swallow one more character and try again from there.
                Some((star_t, star_k)) => {
                    star = Some((star_t, star_k + 1));
                    t = star_t + 1;
                    k = star_k + 1;
                }
                None => return false,
            },
        }
    }
    tokens[t..].iter().all(|token| *token == Token::AnyRun)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_allows_everything() {
        assert!(allows_every_stream("*"));
        assert!(allows_every_stream(" orders:* , * "));
        assert!(!allows_every_stream("outbox:*"));
        assert!(allowed("*", "anything:at:all"));
    }

    #[test]
    fn globs_match_whole_keys() {
        assert!(allowed("outbox:*", "outbox:payment"));
        assert!(allowed("outbox:*", "outbox:"));
        assert!(!allowed("outbox:*", "other:outbox:payment"));
        assert!(!allowed("outbox:*", "outbox"));
        assert!(allowed("orders:?", "orders:1"));
        assert!(!allowed("orders:?", "orders:12"));
        assert!(allowed("a*b*c", "a-x-b-y-b-c"));
        assert!(!allowed("a*b*c", "a-x-b-y-c-d"));
        assert!(allowed("outbox:*, audit:*", "audit:login"));
        assert!(!allowed("Outbox:*", "outbox:x"), "case-sensitive, like Redis keys");
        assert!(allowed("é*", "été"));
    }

    #[test]
    fn a_backslash_makes_wildcards_literal() {
        assert!(allowed(r"weird\*key", "weird*key"));
        assert!(!allowed(r"weird\*key", "weirdXkey"));
        assert!(allowed(r"q\?", "q?"));
        assert!(!allowed(r"q\?", "qx"));
    }

    #[test]
    fn pathological_patterns_stay_fast() {
        // An exponential (recursive) matcher would not finish this one.
        let key = "a".repeat(10_000) + "b";
        assert!(!allowed("*a*a*a*a*a*a*a*a*c", &key));
        assert!(allowed("*a*a*a*a*a*a*a*a*b", &key));
    }

    #[test]
    fn bad_settings_are_explained() {
        assert!(validate("outbox:*,audit:*").is_ok());
        assert!(validate("outbox:*,").unwrap_err().contains("empty"));
        assert!(validate(r"x\").unwrap_err().contains("lone"));
        assert!(validate(r"x\\").is_ok());
    }

    #[test]
    fn long_keys_are_shortened_in_messages() {
        assert_eq!(shown("short"), "short");
        assert_eq!(shown(&"k".repeat(300)).len(), 103);
    }
}
