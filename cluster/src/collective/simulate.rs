//! Executes the plans of all ranks in lockstep in memory, in f32, with the step semantics of
//! [`super::plan`]. The reference the property tests compare against, and a checker: every send must
//! meet exactly one receive of the same length.

use std::collections::HashMap;

use troupe_kernels::reduce::{finish_avg, reduce_into, ReduceOp};

use super::plan::{Action, Combine, Plan};

pub fn simulate(plans: &[Plan], buffers: &mut [Vec<f32>], op: ReduceOp) -> Result<(), String> {
    let n = plans.len();
    assert_eq!(n, buffers.len());
    let steps = plans.iter().map(|p| p.steps.len()).max().unwrap_or(0);
    for s in 0..steps {
        let mut wire: HashMap<(usize, usize), Vec<f32>> = HashMap::new();
        for (rank, plan) in plans.iter().enumerate() {
            for action in plan.steps.get(s).map(|st| st.actions.as_slice()).unwrap_or(&[]) {
                if let Action::Send { to, range } = action {
                    if wire.insert((rank, *to), buffers[rank][range.clone()].to_vec()).is_some() {
                        return Err(format!("step {s}: two sends {rank}->{to}"));
                    }
                }
            }
        }
        for (rank, plan) in plans.iter().enumerate() {
            for action in plan.steps.get(s).map(|st| st.actions.as_slice()).unwrap_or(&[]) {
                match action {
                    Action::Recv { from, range, combine } => {
                        let msg = wire
                            .remove(&(*from, rank))
                            .ok_or(format!("step {s}: rank {rank} waits for {from}, nothing sent"))?;
                        if msg.len() != range.len() {
                            return Err(format!(
                                "step {s}: {from}->{rank} sent {} elements, {} expected",
                                msg.len(),
                                range.len()
                            ));
                        }
                        let dst = &mut buffers[rank][range.clone()];
                        match combine {
                            Combine::Reduce => reduce_into(dst, &msg, op),
                            Combine::Copy => dst.copy_from_slice(&msg),
                        }
                    }
                    Action::Finish { range } if op == ReduceOp::Avg => finish_avg(&mut buffers[rank][range.clone()], n),
                    _ => {}
                }
            }
        }
        if let Some(((from, to), _)) = wire.into_iter().next() {
            return Err(format!("step {s}: send {from}->{to} never received"));
        }
    }
    Ok(())
}
