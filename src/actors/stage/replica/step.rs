//! A replica's training step (DP-1..DP-4): the micro-batches' forward and backward on the
//! device thread, the gradient sync, the optimizer step, and the step's trace and report.

use super::*;

pub(super) async fn step_on_device<M, I>(
    state: &mut StageState<M, I>,
    step: u64,
    micro_batches: Vec<Vec<usize>>,
    global: usize,
) -> Result<StepReport>
where
    M: Module + 'static,
    I: Send + Sync + 'static,
{
    let Some(mut slot) = state.slot.take() else {
        return Err(lost(state.id, &state.device));
    };
    let spec = state.spec.clone();
    let rank = state.rank;
    let device_id = state.device.id();
    let device = state.device.burn().clone();
    let phase = Arc::new(Mutex::new("starting"));
    let thread_phase = phase.clone();
    let out = run_on(&state.device_actor, format!("step {step}"), move || {
        let sent_before = slot.comm.bytes_sent();
        // LOCAL-4: state restored before this rank knew its place in the group.
        let (r, w) = (slot.comm.rank().index(), slot.comm.world());
        match slot.sync.settle(&slot.model, r, w) {
            Ok(Some(model)) => slot.model = model,
            Ok(None) => {}
            Err(e) => return (slot, Err(e.into())),
        }
        let r = train_step(
            &mut slot,
            &spec,
            (&device, device_id),
            rank,
            (step, global),
            &micro_batches,
            &thread_phase,
        );
        let (report, grads) = match r {
            Ok(x) => x,
            Err(e) => return (slot, Err(e)),
        };
        // DP-4 before the update: the buffer broadcast is the step's last collective, so the
        // update is the only thing after it (REC-1 redoes a step only where nothing was
        // applied; REC-7 evens out survivors that finished it and survivors that did not).
        let (slot, report) = sync_buffers(slot, Ok(report), &thread_phase);
        let mut report = match report {
            Ok(r) => r,
            Err(e) => return (slot, Err(e)),
        };
        let (slot, applied) = match grads {
            Some(grads) => with_hooks(
                spec.faults.as_deref(),
                device_id,
                step,
                0,
                Phase::Update,
                || {
                    apply_update(
                        slot,
                        grads,
                        &mut report,
                        (step, &device),
                        &spec,
                        &thread_phase,
                    )
                },
            ),
            None => (slot, Ok(())),
        };
        let applied = applied.map(|()| {
            report.bytes_sent = slot.comm.bytes_sent().saturating_sub(sent_before);
            report
        });
        (slot, applied)
    })
    .await?;
    match out {
        Ok((slot, r)) => {
            state.slot = Some(slot);
            r
        }
        Err(panic) => {
            let during = *phase.lock().unwrap_or_else(|e| e.into_inner());
            Err(failed(state.id, &state.device, during, panic))
        }
    }
}

/// One data-parallel step on the device thread.
pub(super) fn train_step<M: Module, I: Send + Sync + 'static>(
    slot: &mut Slot<M>,
    spec: &StageSpec<M, I>,
    (device, device_id): (&Device, DeviceId),
    rank: Rank,
    (step, global): (u64, usize),
    micro_batches: &[Vec<usize>],
    phase: &Mutex<&'static str>,
) -> Result<(StepReport, Option<Reduced>)> {
    let hooks = spec.faults.as_deref();
    if let Some(h) = &spec.faults {
        // FaultPlan: this step's collective messages are counted from here (COMM-8 hook).
        h.begin_step(device_id, step);
        if h.has_message_faults() {
            slot.comm
                .set_message_hook(Some(DeviceMessages::new(h.clone(), device_id)));
        }
    }
    let set_phase = |p: &'static str| {
        *phase.lock().unwrap_or_else(|e| e.into_inner()) = p;
        report_progress(|| format!("step {step}: {p}"));
    };
    let world = slot.comm.world();
    let k = micro_batches.len();
    // One device, one micro-batch, no clipping, nothing to unscale or narrow: Burn's
    // gradients go straight to the optimizer.
    let mixed = spec.mixed.sync(slot.scaler.is_some());
    let direct = world == 1
        && k == 1
        && spec.clip_norm.is_none()
        && !mixed.find_overflow
        && !mixed.wire.is_low();
    // f16: the loss is multiplied by the scale before backward, the reduced gradient divided.
    let loss_scale = slot.scaler.as_ref().map(LossScaler::scale);
    let ad = device.clone().autodiff();
    let mut trace = Vec::new();
    let mut span = |kind: TraceKind, start: Instant| {
        let s = start.duration_since(spec.epoch);
        trace.push(TraceRecord {
            rank,
            step,
            kind,
            start_us: s.as_micros() as u64,
            duration_us: start.elapsed().as_micros() as u64,
        });
    };
    let gradients = GradientLoop {
        spec,
        device: &ad,
        at: (device_id, step),
        global,
        precision: spec.mixed.precision,
        loss_scale,
    };
    let (grads, micro_losses) = gradients.run(&slot.model, micro_batches, &mut |p| match p {
        Progress::Forward(m) => {
            set_phase("forward");
            report_progress(|| format!("step {step}: forward of micro-batch {m}"));
        }
        Progress::ForwardDone {
            micro_batch,
            samples,
            start,
        } => span(
            TraceKind::Forward {
                micro_batch,
                samples,
            },
            start,
        ),
        Progress::Backward(m) => {
            set_phase("backward");
            report_progress(|| format!("step {step}: backward of micro-batch {m}"));
        }
        Progress::BackwardDone { micro_batch, start } => {
            span(TraceKind::Backward { micro_batch }, start)
        }
    })?;
    let mut loss_sum = 0.0f32;
    for (loss, ids) in micro_losses.iter().zip(micro_batches) {
        loss_sum += loss * ids.len() as f32;
    }
    let local_loss = loss_sum / micro_batches.iter().map(Vec::len).sum::<usize>().max(1) as f32;

    // DP-3: every replica learns every replica's loss and decides the same thing.
    set_phase("all-reduce of losses");
    // FaultPlan: a partition holds this device's messages back for a while.
    if let Some(cut_off) = hooks.and_then(|h| h.partition(device_id, step)) {
        std::thread::sleep(cut_off);
    }
    let mut losses = vec![0.0f32; world];
    losses[rank.index() % world.max(1)] = local_loss;
    if world > 1 {
        slot.comm.all_reduce(&mut losses, ReduceOp::Sum)?;
    }
    let bad: Vec<Rank> = losses
        .iter()
        .enumerate()
        .filter(|(_, l)| !l.is_finite())
        .map(|(r, _)| Rank(r as u32))
        .collect();
    let sample_ids = micro_batches.concat();
    if !bad.is_empty() {
        return match spec.non_finite {
            NonFinitePolicy::Stop => Err(Error::NonFiniteLoss { step, ranks: bad }),
            NonFinitePolicy::Skip => Ok((
                StepReport {
                    rank,
                    sample_ids,
                    local_loss: Some(local_loss),
                    learning_rate: None,
                    trace,
                    pipeline: None,
                    held: None,
                    loss_scale: loss_scale.map(|s| (s, s)),
                    bytes_sent: 0,
                    parameter_server: None,
                },
                None,
            )),
        };
    }

    // DP-2: the mean over replicas of each replica's mean over its micro-batches; the
    // strategy's synchronisation reduces it (all-reduce in buckets, or ZeRO's shards).
    set_phase("gradient reduction");
    let inner = device.clone();
    let local_samples = micro_batches.iter().map(Vec::len).sum::<usize>();
    let mut cx = SyncContext {
        comm: Some(&mut slot.comm),
        device: &inner,
        scale: loss_scale.map_or(1.0, |s| 1.0 / s),
        share: local_samples as f32 / global.max(1) as f32,
        clip: spec.clip_norm,
        direct,
        spans: Vec::new(),
        precision: mixed,
    };
    let reduced = slot.sync.reduce(&slot.model, grads, &mut cx)?;
    let spans = std::mem::take(&mut cx.spans);
    drop(cx);
    record_spans(&mut trace, (rank, step), spec.epoch, spans);
    // PREC-2: every replica holds the same reduced gradient, so every scaler decides alike.
    let scaled = slot.scaler.as_mut().map(|s| {
        let used = s.scale();
        s.update(reduced.non_finite);
        (used, s.scale())
    });
    if reduced.non_finite && spec.non_finite == NonFinitePolicy::Stop && scaled.is_none() {
        return Err(Error::NonFiniteGradient { step });
    }
    let skip = reduced.non_finite;
    Ok((
        StepReport {
            rank,
            sample_ids,
            local_loss: Some(local_loss),
            learning_rate: None,
            trace,
            pipeline: None,
            held: None,
            loss_scale: scaled,
            bytes_sent: 0,
            parameter_server: None,
        },
        (!skip).then_some(reduced),
    ))
}

/// DP-4: buffers (batch-norm statistics, frozen weights) change in forward from each replica's
/// own data; like DDP's `broadcast_buffers`, every replica takes rank 0's after each step, so
/// replicas stay identical.
pub(super) fn sync_buffers<M: Module>(
    mut slot: Slot<M>,
    report: Result<StepReport>,
    phase: &Mutex<&'static str>,
) -> (Slot<M>, Result<StepReport>) {
    if !slot.has_buffers || slot.comm.world() == 1 {
        return (slot, report);
    }
    *phase.lock().unwrap_or_else(|e| e.into_inner()) = "buffer broadcast";
    let comm = &mut slot.comm;
    let (model, synced) = map_parameters(slot.model, ParamFilter::Buffers, |_, values| {
        comm.broadcast(values, Rank(0))
    });
    slot.model = model;
    match synced {
        Ok(()) => (slot, report),
        Err(e) => (slot, Err(e.into())),
    }
}

/// The optimizer step (and whatever exchange the strategy does after it). Takes the slot by
/// value so that the model moves into the optimizer with no other reference to its tensors
/// (no copy of the parameters).
pub(super) fn apply_update<M: Module, I>(
    mut slot: Slot<M>,
    reduced: Reduced,
    report: &mut StepReport,
    (step, device): (u64, &Device),
    spec: &StageSpec<M, I>,
    phase: &Mutex<&'static str>,
) -> (Slot<M>, Result<()>) {
    *phase.lock().unwrap_or_else(|e| e.into_inner()) = "optimizer step";
    // LR-1: the schedule advances only with an applied step.
    let (lr, lr_after) = slot.lr.peek_next();
    report.learning_rate = Some(lr.base());
    let model = slot.model;
    let mut cx = SyncContext {
        comm: Some(&mut slot.comm),
        device,
        scale: 1.0,
        share: 1.0,
        clip: None,
        direct: false,
        spans: Vec::new(),
        precision: SyncPrecision::default(),
    };
    let (model, r) = match slot.sync.apply(model, reduced, lr, &mut cx) {
        Ok(model) => (model, Ok(())),
        Err((model, e)) => (model, Err(e)),
    };
    if r.is_ok() {
        slot.lr.commit(lr_after);
    }
    let spans = std::mem::take(&mut cx.spans);
    drop(cx);
    slot.model = model;
    record_spans(&mut report.trace, (report.rank, step), spec.epoch, spans);
    report.held = Some(slot.sync.held());
    (slot, r.map_err(Error::from))
}

/// The synchronisation's spans (what, when it began, how long) as this rank's trace records
/// of `step`, timed from the job's start.
pub(super) fn record_spans(
    trace: &mut Vec<TraceRecord>,
    (rank, step): (Rank, u64),
    epoch: Instant,
    spans: Vec<(TraceKind, Instant, std::time::Duration)>,
) {
    trace.extend(spans.into_iter().map(|(kind, start, took)| TraceRecord {
        rank,
        step,
        kind,
        start_us: start.duration_since(epoch).as_micros() as u64,
        duration_us: took.as_micros() as u64,
    }));
}
