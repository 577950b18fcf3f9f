//! Timestamps as the relays write them: a timestamptz in RFC 3339, UTC, as `to_char` gives it,
//! computed without the server (every event carries one).

/// Microseconds between 1970-01-01 and PostgreSQL's epoch, 2000-01-01 (UTC).
const POSTGRES_EPOCH_UNIX_US: i64 = 946_684_800_000_000;
/// Microseconds in a day.
const DAY_US: i64 = 86_400_000_000;

/// A timestamptz (microseconds since 2000-01-01 UTC) in RFC 3339 with microseconds, UTC, exactly
/// as `to_char(t AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"')` gives it, which is how the
/// failure path and replays write it (src/sql): a year BC by its number (1 BC as `0001`), years
/// past 9999 with all their digits, and nothing for the infinities (to_char's NULL). Only a
/// superuser's UPDATE or a restored dump can give an event such a `created_at`; the pg_test
/// `created_at_is_written_as_to_char_writes_it` compares the two at every edge.
pub fn timestamptz_text(microseconds: i64) -> String {
    if microseconds == i64::MIN || microseconds == i64::MAX {
        return String::new();
    }
    let (year, month, day, of_day) = utc_date(microseconds);
    if year > 9999 {
        // More than four digits.
        return general_layout(year, month, day, of_day);
    }
    // Digit by digit into a fixed layout: every event carries one, and `write!` spent 4% of the
    // relay's CPU in the drain on them.
    let mut out = *b"0000-00-00T00:00:00.000000Z";
    let mut put = |at: usize, width: usize, mut value: u64| {
        for place in (at..at + width).rev() {
            out[place] = b'0' + (value % 10) as u8;
            value /= 10;
        }
    };
    let seconds = (of_day / 1_000_000) as u64;
    put(0, 4, year as u64);
    put(5, 2, u64::from(month));
    put(8, 2, u64::from(day));
    put(11, 2, seconds / 3600);
    put(14, 2, seconds / 60 % 60);
    put(17, 2, seconds % 60);
    put(20, 6, (of_day % 1_000_000) as u64);
    out.iter().map(|&b| b as char).collect()
}

/// A finite timestamptz's UTC date, its year as to_char's YYYY writes it, and the microseconds
/// into that day.
fn utc_date(microseconds: i64) -> (i64, u32, u32, i64) {
    // Days from 2000-01-01 and then from 1970-01-01: microseconds from 1970 would overflow near
    // PostgreSQL's last timestamp (294276 AD).
    let days = microseconds.div_euclid(DAY_US) + POSTGRES_EPOCH_UNIX_US / DAY_US;
    let (year, month, day) = civil_from_days(days);
    // The proleptic calendar's year 0 is 1 BC, -1 is 2 BC, ...; to_char's YYYY writes their number.
    let year = if year <= 0 { 1 - year } else { year };
    (year, month, day, microseconds.rem_euclid(DAY_US))
}

/// `timestamptz_text`'s layout for any year, through `format!`; `of_day` in microseconds.
fn general_layout(year: i64, month: u32, day: u32, of_day: i64) -> String {
    let seconds = of_day / 1_000_000;
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{:06}Z",
        seconds / 3600,
        seconds / 60 % 60,
        seconds % 60,
        of_day % 1_000_000
    )
}

/// The proleptic Gregorian date of a day count from 1970-01-01 (Howard Hinnant's algorithm).
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let day_of_era = z.rem_euclid(146_097);
    let year_of_era = (day_of_era - day_of_era / 1460 + day_of_era / 36_524 - day_of_era / 146_096) / 365;
    let day_of_year = day_of_era - (365 * year_of_era + year_of_era / 4 - year_of_era / 100);
    let mp = (5 * day_of_year + 2) / 153;
    let day = (day_of_year - (153 * mp + 2) / 5 + 1) as u32;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (year_of_era + era * 400 + i64::from(month <= 2), month, day)
}

#[cfg(test)]
mod tests {
    use super::timestamptz_text;

    #[test]
    fn timestamps_are_written_as_rfc_3339_in_utc() {
        assert_eq!(timestamptz_text(0), "2000-01-01T00:00:00.000000Z");
        assert_eq!(timestamptz_text(-1), "1999-12-31T23:59:59.999999Z");
        // 2026-11-29 20:00:00.123456 UTC
        assert_eq!(timestamptz_text(849_297_600_123_456), "2026-11-29T20:00:00.123456Z");
        // A leap day.
        assert_eq!(timestamptz_text(131_328_000_000_000), "2004-02-29T00:00:00.000000Z");
        assert_eq!(timestamptz_text(i64::MAX), "");
        assert_eq!(timestamptz_text(i64::MIN), "");
        // The last instant of year 9999, and years past it (the general path).
        assert_eq!(timestamptz_text(252_455_615_999_999_999), "9999-12-31T23:59:59.999999Z");
        assert_eq!(timestamptz_text(252_455_616_000_000_000), "10000-01-01T00:00:00.000000Z");
        // The last instant of 2 BC, written by its number as to_char does.
        assert_eq!(timestamptz_text(-63_113_904_000_000_001), "0002-12-31T23:59:59.999999Z");
        // PostgreSQL's last timestamp (an overflow wrote 294247-01-10 for it).
        assert_eq!(timestamptz_text(9_223_371_331_199_999_999), "294276-12-31T23:59:59.999999Z");
    }

    /// The digit-by-digit layout agrees with the general one across the years it covers.
    #[test]
    fn the_fixed_layout_agrees_with_the_general_one() {
        let mut microseconds: i64 = -63_082_281_600_000_000; // 0001-01-01
        while microseconds < 252_455_615_999_999_999 {
            let (year, month, day, of_day) = super::utc_date(microseconds);
            assert_eq!(timestamptz_text(microseconds), super::general_layout(year, month, day, of_day));
            microseconds += 86_399_999_999 * 7 + 123_457;
        }
    }
}
