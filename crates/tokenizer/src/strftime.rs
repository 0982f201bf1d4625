//! `strftime_now(format)`, the one clock-reading helper HuggingFace gives chat templates (Llama 3.1
//! writes "Today Date: 26 Jul 2024" with it).
//!
//! The engine renders with its own clock at nearly the same moment, so the date only differs across
//! midnight. Engines in containers run in UTC, and so does this: the time is UTC, whatever `TZ` says.

/// The civil date and time of a moment, in UTC.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DateTime {
    /// Year.
    pub year: i64,
    /// Month, 1 to 12.
    pub month: u32,
    /// Day of the month, 1 to 31.
    pub day: u32,
    /// Hour, minute and second.
    pub hms: (u32, u32, u32),
    /// Day of the week, 0 = Monday.
    pub weekday: u32,
    /// Day of the year, 1 to 366.
    pub yday: u32,
}

impl DateTime {
    /// The UTC date and time `secs` seconds after the Unix epoch.
    pub fn from_unix(secs: i64) -> Self {
        let days = secs.div_euclid(86_400);
        let rem = secs.rem_euclid(86_400) as u32;
        // Howard Hinnant's days-to-civil algorithm.
        let z = days + 719_468;
        let era = z.div_euclid(146_097);
        let doe = z.rem_euclid(146_097);
        let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
        let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
        let mp = (5 * doy + 2) / 153;
        let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
        let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
        let year = yoe + era * 400 + i64::from(month <= 2);
        let leap = (year % 4 == 0 && year % 100 != 0) || year % 400 == 0;
        const BEFORE: [u32; 12] = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334];
        let yday = BEFORE[month as usize - 1] + day + u32::from(leap && month > 2);
        let weekday = (days + 3).rem_euclid(7) as u32; // 1970-01-01 was a Thursday
        DateTime { year, month, day, hms: (rem / 3600, rem / 60 % 60, rem % 60), weekday, yday }
    }
}

const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];
const DAYS: [&str; 7] = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"];

/// Formats `t` with C `strftime` directives (the common ones; others are written as they are).
pub fn format(t: &DateTime, fmt: &str) -> String {
    let mut out = String::new();
    let mut chars = fmt.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let (h, m, s) = t.hms;
        let month = MONTHS[t.month as usize - 1];
        let day = DAYS[t.weekday as usize];
        match chars.next() {
            Some('d') => out.push_str(&format!("{:02}", t.day)),
            Some('e') => out.push_str(&format!("{:2}", t.day)),
            Some('m') => out.push_str(&format!("{:02}", t.month)),
            Some('Y') => out.push_str(&t.year.to_string()),
            Some('y') => out.push_str(&format!("{:02}", t.year.rem_euclid(100))),
            Some('b') | Some('h') => out.push_str(&month[..3]),
            Some('B') => out.push_str(month),
            Some('a') => out.push_str(&day[..3]),
            Some('A') => out.push_str(day),
            Some('H') => out.push_str(&format!("{h:02}")),
            Some('I') => out.push_str(&format!("{:02}", if h % 12 == 0 { 12 } else { h % 12 })),
            Some('p') => out.push_str(if h < 12 { "AM" } else { "PM" }),
            Some('M') => out.push_str(&format!("{m:02}")),
            Some('S') => out.push_str(&format!("{s:02}")),
            Some('j') => out.push_str(&format!("{:03}", t.yday)),
            Some('u') => out.push_str(&(t.weekday + 1).to_string()),
            Some('w') => out.push_str(&((t.weekday + 1) % 7).to_string()),
            Some('F') => out.push_str(&format!("{}-{:02}-{:02}", t.year, t.month, t.day)),
            Some('T') => out.push_str(&format!("{h:02}:{m:02}:{s:02}")),
            Some('Z') => out.push_str("UTC"),
            Some('z') => out.push_str("+0000"),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_dates_format_like_pythons_strftime() {
        // 2024-07-26 12:34:56 UTC, a Friday.
        let t = DateTime::from_unix(1_721_997_296);
        assert_eq!(format(&t, "%d %b %Y"), "26 Jul 2024");
        assert_eq!(format(&t, "%A %B %e, %H:%M:%S %j %%"), "Friday July 26, 12:34:56 208 %");
        assert_eq!(DateTime::from_unix(0).weekday, 3);
        assert_eq!(format(&DateTime::from_unix(951_782_400), "%F"), "2000-02-29");
        assert_eq!(format(&DateTime::from_unix(-86_400), "%F %a"), "1969-12-31 Wed");
    }
}
