//! The pipeline schedules as pure plans: every generated plan passes the checker over the whole
//! range, the checker catches each kind of broken plan, and the unit-cost bubbles are the textbook ones.

use troupe_actors::engine::pipeline::{
    check, plan, simulate, textbook_bubble, Costs, Op, OpKind, Plan, PlanError, PlanShape, ScheduleKind,
};

fn virtual_range(kind: ScheduleKind) -> std::ops::RangeInclusive<usize> {
    if kind == ScheduleKind::Interleaved {
        1..=3
    } else {
        1..=1
    }
}

#[test]
fn every_generated_plan_is_valid_for_p_1_to_8_m_1_to_16_v_1_to_3() {
    let mut checked = 0;
    for kind in ScheduleKind::ALL {
        for p in 1..=8 {
            for m in 1..=16 {
                for v in virtual_range(kind) {
                    let shape = PlanShape::new(p, m, v);
                    let plan = plan(kind, shape).unwrap();
                    let report = check(&plan).unwrap_or_else(|e| panic!("{kind} P={p} M={m} V={v}: {e}"));
                    let peak = report.peak_activations.iter().copied().max().unwrap();
                    match kind {
                        ScheduleKind::GPipe => assert_eq!(peak, m, "GPipe holds every micro-batch"),
                        ScheduleKind::OneFOneB | ScheduleKind::ZbH1 => {
                            assert_eq!(peak, p.min(m), "{kind} P={p} M={m}: 1F1B's memory")
                        }
                        ScheduleKind::Interleaved => {
                            let megatron = ((p - 1) * 2 + (v - 1) * p + 1).min(m * v);
                            if m % p == 0 {
                                assert_eq!(peak, megatron, "interleaved P={p} M={m} V={v}: Megatron's memory");
                            }
                        }
                    }
                    checked += 1;
                }
            }
        }
    }
    assert_eq!(checked, 8 * 16 * (3 + 3));
}

#[test]
fn gpipe_and_1f1b_bubbles_under_unit_costs_are_the_textbook_ones() {
    for kind in [ScheduleKind::GPipe, ScheduleKind::OneFOneB] {
        for (p, m) in [(2, 1), (2, 4), (4, 4), (4, 8), (8, 16), (3, 7)] {
            let report = check(&plan(kind, PlanShape::new(p, m, 1)).unwrap()).unwrap();
            let bubble = report.timeline.bubble_fraction();
            assert!((bubble - textbook_bubble(p, m)).abs() < 1e-12, "{kind} P={p} M={m}: {bubble}");
            assert_eq!(report.timeline.makespan(), 3.0 * (m + p - 1) as f64);
        }
    }
}

#[test]
fn interleaving_shrinks_the_bubble_by_about_v() {
    for (p, m) in [(2, 4), (4, 8), (4, 16)] {
        let one = check(&plan(ScheduleKind::OneFOneB, PlanShape::new(p, m, 1)).unwrap()).unwrap();
        for v in 2..=3 {
            let inter = check(&plan(ScheduleKind::Interleaved, PlanShape::new(p, m, v)).unwrap()).unwrap();
            // Megatron: the bubble time is (P − 1)·(F + B)/V.
            let idle =
                |t: &troupe_actors::engine::pipeline::Timeline| t.makespan() * p as f64 - t.busy().iter().sum::<f64>();
            let expected = idle(&one.timeline) / v as f64;
            assert!((idle(&inter.timeline) - expected).abs() < 1e-9, "P={p} M={m} V={v}");
        }
    }
}

#[test]
fn zb_h1_idles_a_third_of_1f1b() {
    // Qi et al.: 1F1B idles (P − 1)(F + B + W) per device, ZB-H1 (P − 1)(F + B − W): a third at unit costs.
    for (p, m) in [(2, 4), (2, 8), (4, 4), (4, 8), (8, 16)] {
        let idle = |kind| {
            let t = check(&plan(kind, PlanShape::new(p, m, 1)).unwrap()).unwrap().timeline;
            t.makespan() * p as f64 - t.busy().iter().sum::<f64>()
        };
        let (zb, one) = (idle(ScheduleKind::ZbH1), idle(ScheduleKind::OneFOneB));
        assert!(zb <= one / 3.0 + 1e-9, "P={p} M={m}: ZB-H1 idles {zb}, 1F1B {one}");
    }
}

#[test]
fn simulation_scales_with_costs() {
    let plan = plan(ScheduleKind::OneFOneB, PlanShape::new(2, 2, 1)).unwrap();
    let costs = Costs { forward: 2.0, backward_input: 3.0, backward_weight: 1.0, message: 0.5 };
    // Device 0: F0 [0,2] F1 [2,4]; device 1: F0 [2.5,4.5] B0 [4.5,8.5]; device 0: B0 [9,13] ...
    let t = simulate(&plan, &costs).unwrap();
    let d1_b0 = t.spans[1].iter().find(|(op, _, _)| *op == Op::new(OpKind::Backward, 1, 0)).unwrap();
    assert_eq!((d1_b0.1, d1_b0.2), (4.5, 8.5));
    let d0_b0 = t.spans[0].iter().find(|(op, _, _)| *op == Op::new(OpKind::Backward, 0, 0)).unwrap();
    assert_eq!((d0_b0.1, d0_b0.2), (9.0, 13.0));
}

fn one_f_one_b(p: usize, m: usize) -> Plan {
    plan(ScheduleKind::OneFOneB, PlanShape::new(p, m, 1)).unwrap()
}

fn position(plan: &Plan, device: usize, op: Op) -> usize {
    plan.devices[device].iter().position(|&o| o == op).unwrap_or_else(|| panic!("{op} not on device {device}"))
}

/// Whether a refusal is the expected one.
type Expect<'a> = Box<dyn Fn(&PlanError) -> bool + 'a>;

/// Table of hand-broken plans: (what was broken, the plan, the expected refusal).
#[test]
fn broken_plans_are_refused_with_the_reason() {
    let f = |c, mb| Op::new(OpKind::Forward, c, mb);
    let b = |c, mb| Op::new(OpKind::Backward, c, mb);
    let mut cases: Vec<(&str, Plan, Expect)> = Vec::new();

    let mut missing = one_f_one_b(2, 4);
    let at = position(&missing, 1, b(1, 2));
    missing.devices[1].remove(at);
    cases.push(("a backward dropped", missing, Box::new(|e| matches!(e, PlanError::Missing { op } if *op == b(1, 2)))));

    let mut duplicate = one_f_one_b(2, 4);
    duplicate.devices[0].push(f(0, 1));
    cases.push(("a forward twice", duplicate, Box::new(|e| matches!(e, PlanError::Duplicate { device: 0, .. }))));

    let mut misplaced = one_f_one_b(2, 4);
    let at = position(&misplaced, 1, f(1, 3));
    misplaced.devices[1][at] = f(0, 3);
    cases.push(("a forward on the wrong device", misplaced, Box::new(|e| matches!(e, PlanError::Misplaced { .. }))));

    let mut unneeded_message = plan(ScheduleKind::Interleaved, PlanShape::new(1, 2, 2)).unwrap();
    unneeded_message.devices[0].insert(1, Op::new(OpKind::SendActivation, 0, 0));
    cases.push((
        "a message between chunks of one device",
        unneeded_message,
        Box::new(|e| matches!(e, PlanError::Misplaced { why, .. } if why.contains("same device"))),
    ));

    let mut backward_first = one_f_one_b(2, 4);
    let (fi, bi) = (position(&backward_first, 1, f(1, 0)), position(&backward_first, 1, b(1, 0)));
    backward_first.devices[1].swap(fi, bi);
    cases.push((
        "a backward before its forward",
        backward_first,
        Box::new(|e| matches!(e, PlanError::DependencyViolated { device: 1, needs, .. } if *needs == f(1, 0))),
    ));

    let mut forward_before_receive = one_f_one_b(2, 4);
    let recv = Op::new(OpKind::RecvActivation, 0, 2);
    let (ri, fi) = (position(&forward_before_receive, 1, recv), position(&forward_before_receive, 1, f(1, 2)));
    forward_before_receive.devices[1].swap(ri, fi);
    cases.push((
        "a forward before its input arrives",
        forward_before_receive,
        Box::new(move |e| matches!(e, PlanError::DependencyViolated { needs, .. } if *needs == recv)),
    ));

    // Device 0 waits for micro-batch 0's gradient before sending micro-batch 1's activation; device 1
    // waits for that activation before computing micro-batch 0's backward.
    let mut cycle = one_f_one_b(2, 2);
    cycle.devices[0] = vec![
        f(0, 0),
        Op::new(OpKind::SendActivation, 0, 0),
        Op::new(OpKind::RecvGradient, 1, 0),
        b(0, 0),
        f(0, 1),
        Op::new(OpKind::SendActivation, 0, 1),
        Op::new(OpKind::RecvGradient, 1, 1),
        b(0, 1),
    ];
    cycle.devices[1] = vec![
        Op::new(OpKind::RecvActivation, 0, 0),
        f(1, 0),
        Op::new(OpKind::RecvActivation, 0, 1),
        f(1, 1),
        b(1, 0),
        Op::new(OpKind::SendGradient, 1, 0),
        b(1, 1),
        Op::new(OpKind::SendGradient, 1, 1),
    ];
    cases.push((
        "receives waiting on each other",
        cycle,
        Box::new(|e| matches!(e, PlanError::Deadlock { blocked } if blocked.len() == 2)),
    ));

    // GPipe's order labelled 1F1B holds M activations, over 1F1B's bound of P.
    let mut over_memory = plan(ScheduleKind::GPipe, PlanShape::new(2, 4, 1)).unwrap();
    over_memory.kind = ScheduleKind::OneFOneB;
    cases.push((
        "GPipe's order under 1F1B's memory bound",
        over_memory,
        Box::new(|e| matches!(e, PlanError::ActivationBound { held: 4, bound: 2, .. })),
    ));

    let mut whole_backward_in_zb = plan(ScheduleKind::ZbH1, PlanShape::new(2, 2, 1)).unwrap();
    let at = position(&whole_backward_in_zb, 0, Op::new(OpKind::BackwardInput, 0, 0));
    whole_backward_in_zb.devices[0][at] = b(0, 0);
    cases.push((
        "a whole backward in a split schedule",
        whole_backward_in_zb,
        Box::new(|e| matches!(e, PlanError::Misplaced { .. })),
    ));

    let mut weight_before_input = plan(ScheduleKind::ZbH1, PlanShape::new(2, 2, 1)).unwrap();
    let (bi, wi) = (
        position(&weight_before_input, 1, Op::new(OpKind::BackwardInput, 1, 1)),
        position(&weight_before_input, 1, Op::new(OpKind::BackwardWeight, 1, 1)),
    );
    weight_before_input.devices[1].swap(bi, wi);
    cases.push((
        "W before its B",
        weight_before_input,
        Box::new(|e| matches!(e, PlanError::DependencyViolated { .. })),
    ));

    for (what, plan, expected) in cases {
        match check(&plan) {
            Ok(_) => panic!("{what}: accepted"),
            Err(e) => {
                assert!(expected(&e), "{what}: refused for the wrong reason: {e}");
                println!("{what}: {e}");
            }
        }
    }
}

#[test]
fn bad_shapes_are_refused_with_what_to_change() {
    let err = plan(ScheduleKind::OneFOneB, PlanShape::new(2, 4, 2)).unwrap_err().to_string();
    assert!(err.contains("--schedule interleaved"), "{err}");
    let err = plan(ScheduleKind::GPipe, PlanShape::new(0, 4, 1)).unwrap_err().to_string();
    assert!(err.contains("stages = 0"), "{err}");
    let err = ScheduleKind::parse("pipedream").unwrap_err();
    assert!(err.contains("gpipe, 1f1b, interleaved, zb-h1"), "{err}");
}
