//! Decimal text -> float, with a fast path for the short numbers JSON tensors are made of.
//!
//! The fast path (Clinger's): a decimal with at most 19 significant digits, mantissa `m <= 2^53` and a power of ten
//! `10^e` with `|e| <= 22` is exactly `m` and `10^e` in f64, so one IEEE multiplication or division gives the
//! correctly rounded f64. For f32, rounding that f64 again can only go wrong when it landed exactly on a midpoint
//! between two f32 values (any f32 midpoint is an f64, so no other f64 can sit between the true value and that
//! midpoint); that case, and everything else outside the fast path, goes to `fast_float2`'s complete algorithm.

/// Exact powers of ten in f64.
const POW10: [f64; 23] = [
    1e0, 1e1, 1e2, 1e3, 1e4, 1e5, 1e6, 1e7, 1e8, 1e9, 1e10, 1e11, 1e12, 1e13, 1e14, 1e15, 1e16, 1e17, 1e18, 1e19, 1e20,
    1e21, 1e22,
];

/// A decimal number's parts, when they fit the fast path.
struct Decimal {
    negative: bool,
    mantissa: u64,
    exponent: i32,
    len: usize,
}

const POW10_INT: [u64; 9] = [1, 10, 100, 1_000, 10_000, 100_000, 1_000_000, 10_000_000, 100_000_000];

/// Reads the run of ASCII digits at `s[i..]` into `mantissa` (wrapping: `count` tells when it overflowed), eight at a
/// time where eight bytes are available.
#[inline(always)]
fn digits(s: &[u8], mut i: usize, mantissa: &mut u64, count: &mut u32) -> usize {
    while let Some(chunk) = s.get(i..i + 8) {
        let word = u64::from_le_bytes(chunk.try_into().unwrap_or_default());
        // A byte is a digit when its high nibble is 3 and adding 6 keeps it so. A carry out of a non-digit byte can
        // only disturb the bytes after the first non-digit, which are not used.
        let high = (word & 0xf0f0_f0f0_f0f0_f0f0) ^ 0x3030_3030_3030_3030;
        let overflow = (word.wrapping_add(0x0606_0606_0606_0606) & 0xf0f0_f0f0_f0f0_f0f0) ^ 0x3030_3030_3030_3030;
        let run = (high | overflow).trailing_zeros() / 8;
        let n = run as usize;
        if n == 0 {
            return i;
        }
        // Keep the n digits, moved to the top so the bytes below read as leading zeros.
        let values = word.wrapping_sub(0x3030_3030_3030_3030) << (8 * (8 - n));
        *mantissa = mantissa.wrapping_mul(POW10_INT[n]).wrapping_add(eight_digits(values));
        *count += run;
        i += n;
        if n < 8 {
            return i;
        }
    }
    while let Some(&c) = s.get(i) {
        let d = c.wrapping_sub(b'0');
        if d > 9 {
            break;
        }
        *mantissa = mantissa.wrapping_mul(10).wrapping_add(u64::from(d));
        *count += 1;
        i += 1;
    }
    i
}

/// The value of eight digit values (0..=9) packed in a word, the first in the lowest byte.
#[inline(always)]
fn eight_digits(word: u64) -> u64 {
    const MASK: u64 = 0x0000_00ff_0000_00ff;
    const MUL1: u64 = 100 + (1_000_000 << 32);
    const MUL2: u64 = 1 + (10_000 << 32);
    let pairs = word.wrapping_mul(10).wrapping_add(word >> 8);
    ((pairs & MASK)
        .wrapping_mul(MUL1)
        .wrapping_add(((pairs >> 16) & MASK).wrapping_mul(MUL2)))
        >> 32
}

#[inline(always)]
fn decimal(s: &[u8]) -> Option<Decimal> {
    let negative = s.first() == Some(&b'-');
    let mut i = usize::from(negative);
    let mut mantissa = 0u64;
    let mut count = 0u32;
    let int_start = i;
    i = digits(s, i, &mut mantissa, &mut count);
    if i == int_start {
        return None;
    }
    let mut exponent = 0i32;
    if s.get(i) == Some(&b'.') {
        let frac_start = i + 1;
        i = digits(s, frac_start, &mut mantissa, &mut count);
        if i == frac_start {
            return None;
        }
        exponent = -i32::try_from(i - frac_start).ok()?;
    }
    if matches!(s.get(i), Some(b'e' | b'E')) {
        i += 1;
        let exp_negative = match s.get(i) {
            Some(b'-') => {
                i += 1;
                true
            }
            Some(b'+') => {
                i += 1;
                false
            }
            _ => false,
        };
        let start = i;
        let mut value = 0i32;
        while let Some(&c) = s.get(i) {
            let d = c.wrapping_sub(b'0');
            if d > 9 {
                break;
            }
            value = value.saturating_mul(10).saturating_add(i32::from(d));
            i += 1;
        }
        if i == start {
            return None;
        }
        exponent = exponent.saturating_add(if exp_negative { -value } else { value });
    }
    // Leading zeros count as digits here, which only sends a few more numbers to the slow path.
    (count <= 19).then_some(Decimal {
        negative,
        mantissa,
        exponent,
        len: i,
    })
}

#[inline(always)]
fn clinger(d: &Decimal) -> Option<f64> {
    if d.mantissa > 1 << 53 || d.exponent.unsigned_abs() > 22 {
        return None;
    }
    let m = d.mantissa as f64;
    let power = POW10[d.exponent.unsigned_abs() as usize];
    let value = if d.exponent < 0 { m / power } else { m * power };
    Some(if d.negative { -value } else { value })
}

/// Reciprocal powers of ten, each the f64 nearest to the exact value.
const NEG_POW10: [f64; 23] = [
    1e0, 1e-1, 1e-2, 1e-3, 1e-4, 1e-5, 1e-6, 1e-7, 1e-8, 1e-9, 1e-10, 1e-11, 1e-12, 1e-13, 1e-14, 1e-15, 1e-16, 1e-17,
    1e-18, 1e-19, 1e-20, 1e-21, 1e-22,
];

/// Parses the f32 at the start of `s` (a JSON number), giving the value and the bytes it took.
///
/// Negative powers of ten multiply by the rounded reciprocal instead of dividing (a division's latency was a fifth
/// of the time): that f64 is within 2 ulp of the true value, so rounding it to f32 is right unless an f32 midpoint
/// lies within those 2 ulp, which shows in the 29 bits below the f32 significand and sends the number to the exact
/// path.
#[inline(always)]
pub fn parse_f32(s: &[u8]) -> Option<(f32, usize)> {
    if let Some(d) = decimal(s)
        && d.mantissa <= 1 << 53
        && d.exponent.unsigned_abs() <= 22
    {
        let m = d.mantissa as f64;
        let exponent = d.exponent.unsigned_abs() as usize;
        let (magnitude, margin) = if d.exponent >= 0 {
            (m * POW10[exponent], 0)
        } else {
            (m * NEG_POW10[exponent], 3)
        };
        let distance_to_midpoint = (magnitude.to_bits() & 0x1fff_ffff).abs_diff(0x1000_0000);
        #[allow(clippy::cast_possible_truncation)] // rounding to the nearest f32 is the point
        let narrow = magnitude as f32;
        if distance_to_midpoint > margin && (narrow.is_normal() || magnitude == 0.0) {
            return Some((if d.negative { -narrow } else { narrow }, d.len));
        }
        if let Some(wide) = clinger(&d) {
            let exact_midpoint = wide.to_bits() & 0x1fff_ffff == 0x1000_0000;
            #[allow(clippy::cast_possible_truncation)]
            let narrow = wide as f32;
            if !exact_midpoint && (narrow.is_normal() || wide == 0.0) {
                return Some((narrow, d.len));
            }
        }
    }
    fast_float2::parse_partial::<f32, _>(s).ok()
}

/// Parses the f64 at the start of `s` (a JSON number), giving the value and the bytes it took.
#[inline]
pub fn parse_f64(s: &[u8]) -> Option<(f64, usize)> {
    if let Some(d) = decimal(s)
        && let Some(value) = clinger(&d)
    {
        return Some((value, d.len));
    }
    fast_float2::parse_partial::<f64, _>(s).ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn reference32(s: &str) -> (f32, usize) {
        fast_float2::parse_partial::<f32, _>(s).unwrap()
    }

    #[test]
    fn digit_runs_of_every_length() {
        for text in [
            "7",
            "12",
            "123456789",
            "12345678",
            "1234567890123456789",
            "0000000001",
            "98765432,1",
        ] {
            let (mut m, mut n) = (0u64, 0u32);
            let end = digits(text.as_bytes(), 0, &mut m, &mut n);
            let run: String = text.chars().take_while(char::is_ascii_digit).collect();
            assert_eq!((m, end), (run.parse::<u64>().unwrap(), run.len()), "{text}");
        }
    }

    #[test]
    fn known_values() {
        assert_eq!(parse_f32(b"0.1,"), Some((0.1, 3)));
        assert_eq!(parse_f32(b"-12.5e-1]"), Some((-1.25, 8)));
        assert_eq!(parse_f64(b"1e22"), Some((1e22, 4)));
        assert_eq!(parse_f64(b"123456789012345678901"), Some((123456789012345678901.0, 21)));
        assert_eq!(parse_f32(b"1e39").map(|v| v.0), Some(f32::INFINITY));
        assert_eq!(parse_f32(b"1e-46").map(|v| v.0), Some(0.0));
        // 1 + 2^-24 is an exact f32 midpoint (between 1 and 1 + 2^-23): ties go to even, 1.0.
        assert_eq!(parse_f32(b"1.000000059604644775390625").map(|v| v.0), Some(1.0));
        // Just above that midpoint rounds up.
        assert_eq!(parse_f32(b"1.0000000596046448").map(|v| v.0), Some(1.000_000_1));
        assert_eq!(parse_f32(b"-0").map(|v| v.0.to_bits()), Some((-0.0f32).to_bits()));
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(20_000))]

        #[test]
        fn agrees_with_the_complete_algorithm(mantissa in 0u64..100_000_000_000, point in 0usize..12, exp in -50i32..50, with_exp in any::<bool>(), negative in any::<bool>()) {
            let digits = mantissa.to_string();
            let point = point.min(digits.len());
            let mut text = String::new();
            if negative { text.push('-'); }
            let (int, frac) = digits.split_at(digits.len() - point);
            text.push_str(if int.is_empty() { "0" } else { int });
            if !frac.is_empty() { text.push('.'); text.push_str(frac); }
            if with_exp { text.push_str(&format!("e{exp}")); }
            let (expected32, len) = reference32(&text);
            let (got32, got_len) = parse_f32(text.as_bytes()).unwrap();
            prop_assert_eq!(got32.to_bits(), expected32.to_bits(), "{}", text);
            prop_assert_eq!(got_len, len);
            let expected64: f64 = fast_float2::parse(&text).unwrap();
            prop_assert_eq!(parse_f64(text.as_bytes()).unwrap().0.to_bits(), expected64.to_bits(), "{}", text);
        }

        #[test]
        fn shortest_f32_text_round_trips(bits in any::<u32>()) {
            let value = f32::from_bits(bits);
            prop_assume!(value.is_finite());
            let text = zmij::Buffer::new().format_finite(value).to_owned();
            prop_assert_eq!(parse_f32(text.as_bytes()).unwrap().0.to_bits(), bits, "{}", text);
        }

        #[test]
        fn short_decimals_with_negative_exponents(mantissa in 0u64..(1 << 53), exp in 1u32..=22) {
            let text = format!("{mantissa}e-{exp}");
            prop_assert_eq!(parse_f32(text.as_bytes()).unwrap().0.to_bits(), reference32(&text).0.to_bits(), "{}", text);
        }

        #[test]
        fn near_midpoints(bits in any::<u32>(), extra in 0u32..4) {
            // Decimal renderings of exact f32 midpoints and their neighbours, with many digits.
            let value = f32::from_bits(bits & 0x7f7f_ffff);
            let next = f32::from_bits((bits & 0x7f7f_ffff) + 1);
            let midpoint = (f64::from(value) + f64::from(next)) / 2.0;
            let text = format!("{:.*e}", 10 + extra as usize, midpoint);
            prop_assert_eq!(parse_f32(text.as_bytes()).unwrap().0.to_bits(), reference32(&text).0.to_bits(), "{}", text);
        }
    }
}
