//! The built-in synthetic corpus: English-like sentences from a small grammar, plus counting lines and
//! simple sums. It has structure at several scales (spelling, word order, agreement between a sentence's
//! parts, arithmetic), so a small model's loss falls well below the unigram entropy within a few hundred
//! steps, and it needs no files.

use crate::rng::SplitMix64;

const SUBJECTS: &[&str] =
    &["the cat", "a dog", "the old man", "my sister", "the robot", "a small bird", "the teacher", "our team"];
const VERBS: &[&str] = &["sees", "likes", "builds", "finds", "carries", "paints", "follows", "watches"];
const ADJECTIVES: &[&str] = &["red", "quiet", "large", "broken", "happy", "green", "heavy", "bright"];
const OBJECTS: &[&str] = &["house", "river", "garden", "machine", "letter", "mountain", "window", "song"];
const PLACES: &[&str] = &["in the morning", "near the sea", "after dinner", "on the hill", "at night", "in the city"];

/// Deterministic text of exactly `bytes` bytes (ASCII) from `seed`.
pub fn synthetic_text(bytes: usize, seed: u64) -> Vec<u8> {
    let mut rng = SplitMix64::new(seed);
    let mut out = Vec::with_capacity(bytes + 128);
    let pick = |rng: &mut SplitMix64, words: &[&'static str]| words[rng.below(words.len() as u64) as usize];
    while out.len() < bytes {
        let line = match rng.below(10) {
            0 => {
                let start = rng.below(90);
                let numbers: Vec<String> = (start..start + 6).map(|n| n.to_string()).collect();
                format!("count: {}.\n", numbers.join(" "))
            }
            1 => {
                let (a, b) = (rng.below(50), rng.below(50));
                format!("{a} plus {b} is {}.\n", a + b)
            }
            _ => {
                let subject = pick(&mut rng, SUBJECTS);
                let verb = pick(&mut rng, VERBS);
                let adjective = pick(&mut rng, ADJECTIVES);
                let object = pick(&mut rng, OBJECTS);
                // Agreement the model can learn: the place phrase follows the verb class.
                let place = PLACES[(VERBS.iter().position(|v| *v == verb).unwrap_or(0)) % PLACES.len()];
                format!("{subject} {verb} the {adjective} {object} {place}.\n")
            }
        };
        out.extend_from_slice(line.as_bytes());
    }
    out.truncate(bytes);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_seed_same_text_and_exact_length() {
        let a = synthetic_text(10_000, 3);
        assert_eq!(a.len(), 10_000);
        assert_eq!(a, synthetic_text(10_000, 3));
        assert_ne!(a, synthetic_text(10_000, 4));
        assert!(a.is_ascii());
    }

    #[test]
    fn has_learnable_structure() {
        let text = String::from_utf8(synthetic_text(100_000, 1)).unwrap();
        assert!(text.contains(" plus ") && text.contains("count: ") && text.contains(" the "));
        // Far fewer distinct bytes than 256: a model can do much better than ln(256) quickly.
        let mut seen = [false; 256];
        text.bytes().for_each(|b| seen[b as usize] = true);
        assert!(seen.iter().filter(|&&s| s).count() < 50);
    }

    /// Conditional entropy (nats) of a byte given the previous `order` bytes, estimated on `text`.
    fn conditional_entropy(text: &[u8], order: usize) -> f64 {
        use std::collections::HashMap;
        let mut context_counts: HashMap<&[u8], f64> = HashMap::new();
        let mut joint_counts: HashMap<&[u8], f64> = HashMap::new();
        for window in text.windows(order + 1) {
            *context_counts.entry(&window[..order]).or_default() += 1.0;
            *joint_counts.entry(window).or_default() += 1.0;
        }
        let total = (text.len() - order) as f64;
        joint_counts.iter().map(|(w, &n)| -n / total * (n / context_counts[&w[..order]]).ln()).sum()
    }

    /// The reference trainer's learning test asks for a loss below 1.6 after 200 steps; that must be more
    /// than letter-pair statistics can give, or the test would not show that the model learns.
    #[test]
    fn bigram_statistics_alone_cannot_reach_the_learning_threshold() {
        let text = synthetic_text(1 << 20, 0x7207);
        let unigram = conditional_entropy(&text, 0);
        let bigram = conditional_entropy(&text, 1);
        println!("unigram entropy {unigram:.3} nats, bigram conditional entropy {bigram:.3} nats");
        assert!(unigram > 2.5, "unigram {unigram}");
        assert!(bigram > 1.6, "bigram {bigram}");
    }
}
