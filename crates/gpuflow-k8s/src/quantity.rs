//! Kubernetes resource quantities (`500m`, `2`, `1.5Gi`, `1e3`) as numbers.

/// The value of a quantity, times `scale` (1000 for milli-CPU), rounded up
/// as Kubernetes rounds requests; `None` for a malformed one.
pub fn parse(q: &str, scale: f64) -> Option<u64> {
    let q = q.trim();
    let split = q
        .find(|c: char| !(c.is_ascii_digit() || c == '.' || c == '+' || c == '-'))
        .unwrap_or(q.len());
    let (number, suffix) = q.split_at(split);
    let number: f64 = number.parse().ok()?;
    let factor = match suffix {
        "" => 1.0,
        "m" => 1e-3,
        "k" => 1e3,
        "M" => 1e6,
        "G" => 1e9,
        "T" => 1e12,
        "P" => 1e15,
        "E" => 1e18,
        "Ki" => 1024.0,
        "Mi" => 1024.0_f64.powi(2),
        "Gi" => 1024.0_f64.powi(3),
        "Ti" => 1024.0_f64.powi(4),
        "Pi" => 1024.0_f64.powi(5),
        "Ei" => 1024.0_f64.powi(6),
        e if e.starts_with(['e', 'E']) => 10f64.powi(e[1..].parse().ok()?),
        _ => return None,
    };
    let v = number * factor * scale;
    (v.is_finite() && v >= 0.0).then(|| v.ceil() as u64)
}

/// Milli-units of a CPU quantity.
pub fn milli(q: &str) -> Option<u64> {
    parse(q, 1000.0)
}

/// MiB of a memory quantity, rounded up.
pub fn mib(q: &str) -> Option<u64> {
    parse(q, 1.0 / (1024.0 * 1024.0))
}

/// A whole count (GPUs, MIG instances); `None` unless a non-negative integer.
pub fn count(q: &str) -> Option<u64> {
    let v = parse(q, 1000.0)?;
    (v % 1000 == 0).then_some(v / 1000)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantities_read_as_kubernetes_writes_them() {
        assert_eq!(milli("500m"), Some(500));
        assert_eq!(milli("2"), Some(2000));
        assert_eq!(milli("1.5"), Some(1500));
        assert_eq!(mib("1Gi"), Some(1024));
        assert_eq!(mib("512Mi"), Some(512));
        assert_eq!(mib("1G"), Some(954));
        assert_eq!(mib("1e9"), Some(954));
        assert_eq!(count("8"), Some(8));
        assert_eq!(count("1.5"), None, "half a GPU is not a count");
        assert_eq!(milli("two"), None);
        assert_eq!(milli("1Zi"), None);
        assert_eq!(milli("-1"), None);
    }
}
