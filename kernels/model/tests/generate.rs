//! Sampling and evaluation: the key/value cache path equals the whole-sequence forward (logits within
//! 1e-5 relative, the same greedy and seeded tokens) for both families, GQA and a tied head included;
//! greedy decoding equals transformers' `generate(do_sample=False)` token for token; evaluation's loss is
//! the reference model's mean loss; bad requests are refused with the fix.

use tch::{Kind, Tensor};
use troupe_model::config::JobConfig;
use troupe_model::data::Corpus;
use troupe_model::generate::{evaluate, generate, generate_uncached, GenerateError, Sampling};
use troupe_model::model::{cross_entropy, KvCache, Model, ModelConfig};
use troupe_model::oracle::transformers_oracle;

fn models() -> Vec<(&'static str, ModelConfig)> {
    let mut tied = JobConfig::small_llama(1).model;
    tied.tie_word_embeddings = true;
    tied.n_layers = 2;
    let mut gpt = JobConfig::small(1).model;
    gpt.n_layers = 2;
    vec![("gpt2", gpt), ("llama-gqa", JobConfig::small_llama(1).model), ("llama-tied", tied)]
}

fn relative(a: &Tensor, b: &Tensor) -> f64 {
    (a - b).norm().double_value(&[]) / b.norm().double_value(&[])
}

#[test]
fn the_cache_path_equals_the_whole_sequence() {
    tch::set_num_threads(1);
    for (name, config) in models() {
        let model = Model::new(config.clone(), 3);
        let tokens = Tensor::randint(config.vocab_size as i64, [1, 12], (Kind::Int64, tch::Device::Cpu));
        let full = tch::no_grad(|| model.forward(&tokens));
        // The prompt at once, then a chunk of three, then one token at a time.
        let mut cache = KvCache::new(config.n_layers);
        let mut pieces = Vec::new();
        tch::no_grad(|| {
            for (start, len) in [(0, 5), (5, 3), (8, 1), (9, 1), (10, 1), (11, 1)] {
                pieces.push(model.forward_cached(&tokens.narrow(1, start, len), &mut cache));
            }
        });
        assert_eq!(cache.len(), 12);
        let cached = Tensor::cat(&pieces, 1);
        let worst = relative(&cached, &full);
        assert!(worst <= 1e-5, "{name}: cached logits differ by {worst:e} relative");

        let prompt: Vec<i64> = Vec::try_from(tokens.get(0).narrow(0, 0, 4)).unwrap();
        for sampling in [Sampling::greedy(), Sampling { temperature: 0.8, top_k: 20, top_p: 0.9, seed: 7, eos: None }] {
            let mut streamed = Vec::new();
            let with_cache = generate(&model, &prompt, 16, sampling, |t| streamed.push(t)).unwrap();
            let without = generate_uncached(&model, &prompt, 16, sampling).unwrap();
            assert_eq!(with_cache, without, "{name} {sampling:?}");
            assert_eq!(streamed, with_cache, "{name}: every token streamed as chosen");
            assert_eq!(with_cache.len(), 16);
            // With the fifth token as the end of text, both paths stop right after it.
            let eos = Sampling { eos: Some(with_cache[4]), ..sampling };
            let stopped = generate(&model, &prompt, 16, eos, |_| {}).unwrap();
            let first = with_cache.iter().position(|&t| t == with_cache[4]).unwrap();
            assert_eq!(stopped, with_cache[..=first], "{name}: stops at the first end of text");
            assert_eq!(generate_uncached(&model, &prompt, 16, eos).unwrap(), stopped, "{name}");
        }
    }
}

/// On a GPU the cache path equals the whole-sequence forward there too, and greedy decoding matches the
/// uncached one. Skips with `no CUDA device` where libtorch sees none.
#[test]
fn the_cache_path_on_cuda_equals_the_whole_sequence() {
    if !tch::Cuda::is_available() {
        println!("the_cache_path_on_cuda_equals_the_whole_sequence: skipped, no CUDA device: libtorch sees none");
        return;
    }
    let gpu = tch::Device::Cuda(0);
    for (name, config) in models() {
        let model = Model::new(config.clone(), 3).to_device(gpu);
        let tokens = Tensor::randint(config.vocab_size as i64, [2, 12], (Kind::Int64, gpu));
        let full = tch::no_grad(|| model.forward(&tokens));
        let mut cache = KvCache::new(config.n_layers);
        let pieces: Vec<Tensor> = tch::no_grad(|| {
            [(0, 5), (5, 3), (8, 1), (9, 1), (10, 1), (11, 1)]
                .iter()
                .map(|&(start, len)| model.forward_cached(&tokens.narrow(1, start, len), &mut cache))
                .collect()
        });
        let worst = relative(&Tensor::cat(&pieces, 1), &full);
        println!("{name} on cuda: cached logits within {worst:e} relative");
        assert!(worst <= 1e-5, "{name}: cached logits on cuda differ by {worst:e} relative");
        let prompt = [1i64, 2, 3, 4];
        let with_cache = generate(&model, &prompt, 16, Sampling::greedy(), |_| {}).unwrap();
        assert_eq!(with_cache, generate_uncached(&model, &prompt, 16, Sampling::greedy()).unwrap(), "{name} on cuda");
    }
}

#[test]
fn greedy_decoding_equals_transformers_generate() {
    tch::set_num_threads(1);
    let dir = tempfile::tempdir().unwrap();
    transformers_oracle(&["make", dir.path().to_str().unwrap()]).unwrap();
    for name in ["llama_gqa", "llama_tied_rope3", "qwen2", "gpt2_tied"] {
        let model_dir = dir.path().join(name);
        let config =
            ModelConfig { from_hf: Some(model_dir.clone()), ..troupe_model::hf::read_config(&model_dir).unwrap() };
        let model = Model::load(config.clone(), 0).unwrap();
        let prompt = Tensor::from_slice(&[3i64, 17, 42, 5, 60]).view([1, 5]);
        let prompt_file = dir.path().join(format!("{name}-prompt.safetensors"));
        Tensor::write_safetensors(&[("tokens", &prompt)], &prompt_file).unwrap();
        let theirs =
            transformers_oracle(&["generate", model_dir.to_str().unwrap(), prompt_file.to_str().unwrap(), "20"])
                .unwrap();
        let theirs: Vec<i64> = serde_json::from_value(theirs["tokens"].clone()).unwrap();
        let ours = generate(&model, &[3, 17, 42, 5, 60], 20, Sampling::greedy(), |_| {}).unwrap();
        assert_eq!(&theirs[5..], &ours[..], "{name}: greedy tokens differ from transformers' generate");
    }
}

#[test]
fn evaluation_is_the_mean_loss_over_the_windows_and_bad_requests_are_refused() {
    tch::set_num_threads(1);
    let config = JobConfig::small_llama(1).model;
    let model = Model::new(config.clone(), 9);
    let context = config.context;
    let tokens: Vec<u16> = (0..(5 * context + 3)).map(|i| ((i * 7 + i / 3) % 256) as u16).collect();
    let corpus = Corpus::from_tokens(tokens.clone(), "test");
    let eval = evaluate(&model, &corpus, 0, 2).unwrap();
    assert_eq!((eval.windows, eval.tokens), (5, 5 * context));
    let mut losses = Vec::new();
    for w in 0..5 {
        let window = |offset: usize| {
            let values: Vec<i64> =
                tokens[w * context + offset..w * context + offset + context].iter().map(|&t| t.into()).collect();
            Tensor::from_slice(&values).view([1, context as i64])
        };
        losses.push(tch::no_grad(|| cross_entropy(&model.forward(&window(0)), &window(1)).double_value(&[])));
    }
    let reference = losses.iter().sum::<f64>() / 5.0;
    assert!((eval.loss - reference).abs() <= 1e-6 * reference, "{} vs {reference}", eval.loss);
    assert!((eval.perplexity - reference.exp()).abs() <= 1e-6 * reference.exp());
    assert_eq!(evaluate(&model, &corpus, 2, 8).unwrap().windows, 2);

    let short = Corpus::from_tokens(vec![1; context], "short");
    assert!(matches!(evaluate(&model, &short, 0, 1), Err(GenerateError::CorpusTooShort { .. })));
    let mut foreign = tokens.clone();
    foreign[7] = 300;
    let refused = evaluate(&model, &Corpus::from_tokens(foreign, "foreign"), 0, 1).unwrap_err().to_string();
    assert!(refused.contains("corpus token 300 at position 7 is outside the model's vocabulary of 256"), "{refused}");
    let long: Vec<i64> = vec![1; context + 1];
    let refused = |prompt: &[i64], sampling| generate(&model, prompt, 4, sampling, |_| {}).unwrap_err().to_string();
    assert!(refused(&long, Sampling::greedy()).contains(&format!("context of {context} positions")));
    assert!(refused(&[1, 300], Sampling::greedy())
        .contains("token 300 at position 1 is outside the model's vocabulary of 256"));
    assert!(refused(&[], Sampling::greedy()).contains("empty"));
    assert!(refused(&[1], Sampling { temperature: -1.0, ..Sampling::greedy() }).contains("--temperature"));
    // A prompt that nearly fills the context gets the room there is.
    let near: Vec<i64> = vec![1; context - 2];
    assert_eq!(generate(&model, &near, 10, Sampling::greedy(), |_| {}).unwrap().len(), 2);
}
