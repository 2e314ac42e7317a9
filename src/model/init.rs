//! Weights drawn at random from one seeded stream, in model order, so each weight's values
//! depend on the seed and its place in that order only. A model whose weights are about to be
//! loaded skips the draws ([`Init::deferred`]): the stream still moves past each weight (a
//! SplitMix64 stream skips ahead in O(1)), and the weights the file lacks (a new classifier)
//! are drawn afterwards from where the stream stood ([`Deferred::draw`]), to the bit what an
//! eager build draws. Drawing 22.7 M normals (MiniLM) only to overwrite them was most of
//! `predict`'s start.

use super::Model;
use super::layers::normal_init;
use crate::device::Device;
use crate::error::Result;
use crate::rng::Rng;

/// The stream weights are drawn from while a model is built.
pub struct Init {
    rng: Rng,
    /// `Some` when the draws are put off: where each weight's would have started.
    deferred: Option<Vec<Draw>>,
}

/// A put-off draw: the weight, the stream where its values start, how many, their deviation.
struct Draw {
    name: String,
    at: Rng,
    n: usize,
    std: f64,
}

impl Init {
    /// Draws as the model is built.
    pub fn new(seed: u64) -> Self {
        Init { rng: Rng::new(seed), deferred: None }
    }

    /// Zeros as the model is built; [`Deferred::draw`] draws the weights asked for later.
    pub fn deferred(seed: u64) -> Self {
        Init { rng: Rng::new(seed), deferred: Some(Vec::new()) }
    }

    /// `n` values from N(0, std²) for the weight `name` (zeros when put off).
    pub fn normal(&mut self, name: &str, n: usize, std: f64) -> Vec<f32> {
        match &mut self.deferred {
            None => normal_init(&mut self.rng, n, std),
            Some(draws) => {
                draws.push(Draw { name: name.to_string(), at: self.rng.clone(), n, std });
                // Each normal takes two of the stream's values.
                self.rng.skip(2 * n as u64);
                vec![0.0; n]
            }
        }
    }

    /// What was put off (nothing for an eager build).
    pub fn into_deferred(self) -> Deferred {
        Deferred { draws: self.deferred.unwrap_or_default() }
    }
}

/// The draws a [deferred](Init::deferred) build put off.
pub struct Deferred {
    draws: Vec<Draw>,
}

impl Deferred {
    /// Draws the weights named in `names` (those a loaded file lacked) into `model`, as an eager
    /// build would have; hollow ones (another process's) stay hollow. Names that were never
    /// drawn (LayerNorms, biases: constants) are left as built. A tied LM head, which an eager
    /// build copies from the embedding, gets the embedding's draw.
    pub fn draw<D: Device>(&self, model: &mut Model<D>, dev: &D, names: &[String]) -> Result<()> {
        let (source, copy) = match &model.tied {
            Some([(_, source), (_, copy)]) => (source.clone(), copy.clone()),
            None => Default::default(),
        };
        for p in model.params_mut().into_iter().filter(|p| names.contains(&p.name) && !p.is_hollow()) {
            let drawn_as = if p.name == copy { &source } else { &p.name };
            if let Some(d) = self.draws.iter().find(|d| &d.name == drawn_as) {
                p.value = dev.upload(&normal_init(&mut d.at.clone(), d.n, d.std))?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::CpuDevice;
    use crate::model::Pooling;
    use crate::model::tiny::{tiny_bert, tiny_gpt, tiny_vit};

    fn values(model: &Model<CpuDevice<f32>>) -> Vec<(String, Vec<u32>)> {
        model.params().iter().map(|p| (p.name.clone(), p.value.iter().map(|v| v.to_bits()).collect())).collect()
    }

    /// A build for loading puts every draw off, and drawing what a file lacked afterwards gives
    /// the bits a random build gives: all of them, or the head alone (the rest stays zero, for
    /// the file to fill). A tied LM head gets its embedding's draw, even where the embedding is
    /// another process's (hollow).
    #[test]
    fn put_off_draws_are_the_random_builds_bits() {
        let dev = CpuDevice::<f32>::new(0, 1).unwrap();
        for config in [tiny_bert(Pooling::ClsPooler, 0.1), tiny_vit(0.1), tiny_gpt(0.1)] {
            let eager = values(&Model::new(&dev, &config, 9).unwrap());
            let (mut later, deferred) = Model::new_for_loading(&dev, &config, 9, &|_| true).unwrap();
            deferred.draw(&mut later, &dev, &["classifier.weight".to_string()]).unwrap();
            for (name, bits) in values(&later) {
                let want = &eager.iter().find(|(n, _)| *n == name).unwrap().1;
                // Drawn at random: not one constant (LayerNorms are 1, biases 0).
                let random = want.iter().any(|&b| b != want[0]);
                match name.as_str() {
                    "classifier.weight" => assert_eq!(&bits, want, "{name}"),
                    _ if random => {
                        assert!(bits.iter().all(|&b| b == 0), "{name} drawn before it was asked for")
                    }
                    _ => {}
                }
            }
            let all: Vec<String> = later.params().iter().map(|p| p.name.clone()).collect();
            deferred.draw(&mut later, &dev, &all).unwrap();
            assert_eq!(values(&later), eager, "{:?}", later.spec().family);
            // Unit 0 (the embedding) another process's: the rest, the tied head included.
            let (mut rest, deferred) = Model::new_for_loading(&dev, &config, 9, &|u| u != 0).unwrap();
            deferred.draw(&mut rest, &dev, &all).unwrap();
            for (name, bits) in values(&rest).into_iter().filter(|(_, b)| !b.is_empty()) {
                assert_eq!(&bits, &eager.iter().find(|(n, _)| *n == name).unwrap().1, "{name}");
            }
        }
    }
}
