//! Clusters other schedulers run (gpuflow on Kubernetes): their reports of
//! the workloads they run and keep waiting (`external.rs`).

use super::*;

/// The largest report: 100,000 workloads of a few hundred bytes.
const MAX_REPORT_BYTES: usize = 64 << 20;

pub(super) fn router() -> ApiRouter {
    ApiRouter::new().api_route("/v1/clusters/{cluster}/workloads", put_with(report, doc("admin (a cluster's scheduler)", "Report every workload another scheduler (gpuflow on Kubernetes) runs or keeps waiting now; they are accounted and shown as jobs, and those the last report had and this one does not have finished")).layer(DefaultBodyLimit::max(MAX_REPORT_BYTES)))
}

/// Records a cluster's report: every workload it runs or keeps waiting now.
async fn report(
    State(shared): State<Arc<Shared>>,
    caller: Caller,
    Path(cluster): Path<String>,
    body: JsonBody<api::WorkloadReport>,
) -> Reply<api::WorkloadReportResult> {
    caller.need_admin("reporting a cluster's workloads")?;
    check_name("cluster", &cluster, "cluster")?;
    let r: api::WorkloadReport = body.read(MAX_REPORT_BYTES)?;
    let mut world = shared.write().await;
    let at = shared.now();
    let (records, result) = crate::external::apply(&world, &cluster, &r, at);
    let mut change = Change::default();
    change.batch.put.extend(records.iter().map(JobRec::record));
    let new = records
        .iter()
        .filter(|j| !world.external().contains_key(&j.id) && !j.state.finished())
        .count();
    if new > 0 || result.finished > 0 {
        change.audit(
            at,
            &caller.user.name,
            "cluster.report",
            &format!("cluster/{cluster}"),
            format!("{new} new workloads, {} finished", result.finished),
        );
    }
    world = world.commit(change).await?;
    for j in records {
        world.put_external(j);
    }
    Ok(Json(result))
}
