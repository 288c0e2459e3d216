//! Triton's statistics of model versions, summed over the fleet: a public version's numbers are the sum of what every
//! endpoint of its backend reports for the backend's model, so a client sees the fleet as one server.

use std::sync::Arc;

use futures_util::future::join_all;
use http::{HeaderMap, Method, StatusCode};
use prost::Message;

use super::Dispatcher;
use super::backend::{BackendClients, Replicas};
use crate::codec::rest;
use crate::error::{Error, ErrorKind, Origin, Result};
use crate::proto::{
    InferBatchStatistics, InferResponseStatistics, InferStatistics, ModelStatistics, ModelStatisticsRequest,
    ModelStatisticsResponse, StatisticDuration,
};
use crate::routing::VersionRoute;

const MODEL_STATISTICS: &str = "/inference.GRPCInferenceService/ModelStatistics";

impl Dispatcher {
    /// The statistics of `model` at `version` (each routed version when `None`), or of every routed model version
    /// when `model` is `None`, named as the gateway routes them, in configuration order. Every endpoint is asked at
    /// once. A named model whose backend keeps no statistics is 501 / UNIMPLEMENTED naming the backend; asked for
    /// every model, models whose statistics cannot be read are left out.
    pub async fn model_statistics(&self, model: Option<&str>, version: Option<&str>) -> Result<Vec<ModelStatistics>> {
        let routes: Vec<Arc<VersionRoute>> = match (model, version.filter(|v| !v.is_empty())) {
            (Some(model), Some(version)) => vec![self.routes.resolve(model, Some(version))?.clone()],
            (Some(model), None) => self.routes.model_routes(model)?,
            (None, _) => self.routes.routes().to_vec(),
        };
        let answers = join_all(routes.iter().map(|route| self.route_statistics(route))).await;
        let mut statistics = Vec::new();
        for answer in answers {
            match answer {
                Ok(summed) => statistics.push(summed),
                // The fleet's overview leaves out what it cannot read (a backend without statistics, or none of
                // whose endpoints answered), as Triton's leaves out models it has not loaded.
                Err(error) if model.is_none() => {
                    tracing::debug!(error = %error.message(), "model statistics left out");
                }
                Err(error) => return Err(error),
            }
        }
        Ok(statistics)
    }

    /// One public version's statistics: the sum over the endpoints that answered (an endpoint that cannot be reached
    /// is left out of the sum); an error only when none answered.
    async fn route_statistics(&self, route: &VersionRoute) -> Result<ModelStatistics> {
        let backend = self.backend(route)?;
        let asked = (0..backend.fleet.states.len()).map(|index| self.endpoint_statistics(backend, index, route));
        let mut summed: Option<ModelStatistics> = None;
        let mut failure = None;
        for answer in join_all(asked).await {
            match answer {
                Ok(reported) => add(summed.get_or_insert_with(empty), &reported),
                Err(error) => {
                    tracing::warn!(backend = %backend.name, error = %error.message(), "model statistics not read");
                    failure.get_or_insert(error);
                }
            }
        }
        let mut summed = match (summed, failure) {
            (Some(summed), _) => summed,
            (None, Some(failure)) => return Err(failure),
            (None, None) => return Err(Error::internal(format!("backend {} has no endpoints", backend.name))),
        };
        summed.name = route.model.clone();
        summed.version = route.version.clone();
        Ok(summed)
    }

    /// What one endpoint reports for the route's backend model: the entry of its version (of its latest version when
    /// the route names none), or zeros when it reports none.
    async fn endpoint_statistics(
        &self,
        backend: &BackendClients,
        index: usize,
        route: &VersionRoute,
    ) -> Result<ModelStatistics> {
        let authority = backend.fleet.states.get(index).map_or("", |state| &*state.authority);
        let unimplemented = |why: String| {
            Error::new(
                ErrorKind::Unimplemented,
                Origin::Upstream,
                format!("backend {} keeps no model statistics ({why})", backend.name),
            )
        };
        let deadline = Some(self.request_timeout);
        let reported = match &backend.replicas {
            Replicas::Rest { endpoints, .. } => {
                let endpoint = endpoints
                    .get(index)
                    .ok_or_else(|| Error::internal("no such endpoint"))?;
                let path = crate::upstream::rest::model_path(&route.upstream_name, route.backend_version(), "/stats");
                let answer = endpoint
                    .send(Method::GET, &path, &HeaderMap::new(), Vec::new(), deadline)
                    .await?;
                // A server without the extension has no such path.
                if matches!(
                    answer.status,
                    StatusCode::NOT_FOUND | StatusCode::METHOD_NOT_ALLOWED | StatusCode::NOT_IMPLEMENTED
                ) {
                    return Err(unimplemented(format!(
                        "{authority} answered {path} with {}",
                        answer.status
                    )));
                }
                endpoint.check(&answer)?;
                rest::decode_model_statistics(&answer.body).map_err(Error::into_upstream_protocol_error)?
            }
            Replicas::Grpc { endpoints } => {
                let endpoint = endpoints
                    .get(index)
                    .ok_or_else(|| Error::internal("no such endpoint"))?;
                let request = ModelStatisticsRequest {
                    name: route.upstream_name.clone(),
                    version: route.upstream_version.clone(),
                };
                let answer = endpoint
                    .unary(
                        MODEL_STATISTICS,
                        vec![request.encode_to_vec().into()],
                        deadline,
                        &HeaderMap::new(),
                        None,
                    )
                    .await
                    .map_err(|error| match error.kind() {
                        ErrorKind::Unimplemented => {
                            unimplemented(format!("{authority} answered UNIMPLEMENTED: {}", error.message()))
                        }
                        _ => error,
                    })?;
                ModelStatisticsResponse::decode(answer.value).map_err(|e| {
                    Error::new(
                        ErrorKind::BadGateway,
                        Origin::Upstream,
                        format!("backend {} sent invalid statistics: {e}", backend.name),
                    )
                })?
            }
        };
        Ok(version_entry(reported, route).unwrap_or_else(empty))
    }
}

/// The entry of the route's backend model and version; of the highest version when the route names none.
fn version_entry(reported: ModelStatisticsResponse, route: &VersionRoute) -> Option<ModelStatistics> {
    let entries = reported
        .model_stats
        .into_iter()
        .filter(|entry| entry.name == route.upstream_name);
    if route.upstream_version.is_empty() {
        return entries.max_by_key(|entry| entry.version.parse::<u64>().unwrap_or(0));
    }
    entries
        .into_iter()
        .find(|entry| entry.version == route.upstream_version)
}

/// Statistics with every count at zero and every stage present.
pub(crate) fn empty() -> ModelStatistics {
    let mut statistics = ModelStatistics::default();
    add(&mut statistics, &ModelStatistics::default());
    statistics
}

/// Adds `more` into `total`: counts and nanoseconds stage by stage, batch sizes and response places matched by key,
/// memory by device; the later of the two last inferences.
pub(crate) fn add(total: &mut ModelStatistics, more: &ModelStatistics) {
    total.last_inference = total.last_inference.max(more.last_inference);
    total.inference_count = total.inference_count.saturating_add(more.inference_count);
    total.execution_count = total.execution_count.saturating_add(more.execution_count);
    let stages = total.inference_stats.get_or_insert_with(InferStatistics::default);
    let default = InferStatistics::default();
    let more_stages = more.inference_stats.as_ref().unwrap_or(&default);
    for (into, from) in infer_stages(stages).into_iter().zip(infer_stages_of(more_stages)) {
        add_duration(into, from);
    }
    for batch in &more.batch_stats {
        let into = match total.batch_stats.iter().position(|b| b.batch_size == batch.batch_size) {
            Some(found) => &mut total.batch_stats[found],
            None => {
                total.batch_stats.push(InferBatchStatistics {
                    batch_size: batch.batch_size,
                    ..Default::default()
                });
                total.batch_stats.last_mut().unwrap_or_else(|| unreachable!())
            }
        };
        for (into, from) in [
            (&mut into.compute_input, &batch.compute_input),
            (&mut into.compute_infer, &batch.compute_infer),
            (&mut into.compute_output, &batch.compute_output),
        ] {
            add_duration(into, from.as_ref());
        }
    }
    for usage in &more.memory_usage {
        match total
            .memory_usage
            .iter_mut()
            .find(|u| u.r#type == usage.r#type && u.id == usage.id)
        {
            Some(into) => into.byte_size = into.byte_size.saturating_add(usage.byte_size),
            None => total.memory_usage.push(usage.clone()),
        }
    }
    for (place, responses) in &more.response_stats {
        let into = total.response_stats.entry(place.clone()).or_default();
        for (into, from) in response_stages(into).into_iter().zip(response_stages_of(responses)) {
            add_duration(into, from);
        }
    }
}

fn add_duration(total: &mut Option<StatisticDuration>, more: Option<&StatisticDuration>) {
    let total = total.get_or_insert_with(StatisticDuration::default);
    if let Some(more) = more {
        total.count = total.count.saturating_add(more.count);
        total.ns = total.ns.saturating_add(more.ns);
    }
}

fn infer_stages(stats: &mut InferStatistics) -> [&mut Option<StatisticDuration>; 8] {
    [
        &mut stats.success,
        &mut stats.fail,
        &mut stats.queue,
        &mut stats.compute_input,
        &mut stats.compute_infer,
        &mut stats.compute_output,
        &mut stats.cache_hit,
        &mut stats.cache_miss,
    ]
}

fn infer_stages_of(stats: &InferStatistics) -> [Option<&StatisticDuration>; 8] {
    [
        stats.success.as_ref(),
        stats.fail.as_ref(),
        stats.queue.as_ref(),
        stats.compute_input.as_ref(),
        stats.compute_infer.as_ref(),
        stats.compute_output.as_ref(),
        stats.cache_hit.as_ref(),
        stats.cache_miss.as_ref(),
    ]
}

fn response_stages(stats: &mut InferResponseStatistics) -> [&mut Option<StatisticDuration>; 6] {
    [
        &mut stats.compute_infer,
        &mut stats.compute_output,
        &mut stats.success,
        &mut stats.fail,
        &mut stats.empty_response,
        &mut stats.cancel,
    ]
}

fn response_stages_of(stats: &InferResponseStatistics) -> [Option<&StatisticDuration>; 6] {
    [
        stats.compute_infer.as_ref(),
        stats.compute_output.as_ref(),
        stats.success.as_ref(),
        stats.fail.as_ref(),
        stats.empty_response.as_ref(),
        stats.cancel.as_ref(),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn duration(count: u64, ns: u64) -> Option<StatisticDuration> {
        Some(StatisticDuration { count, ns })
    }

    #[test]
    fn replicas_add_up_stage_by_stage_and_key_by_key() {
        let a = ModelStatistics {
            last_inference: 10,
            inference_count: 3,
            execution_count: 2,
            inference_stats: Some(InferStatistics {
                success: duration(3, 300),
                ..Default::default()
            }),
            batch_stats: vec![InferBatchStatistics {
                batch_size: 1,
                compute_infer: duration(2, 20),
                ..Default::default()
            }],
            ..Default::default()
        };
        let b = ModelStatistics {
            last_inference: 7,
            inference_count: 1,
            execution_count: 1,
            inference_stats: Some(InferStatistics {
                success: duration(1, 50),
                fail: duration(1, 5),
                ..Default::default()
            }),
            batch_stats: vec![
                InferBatchStatistics {
                    batch_size: 1,
                    compute_infer: duration(1, 1),
                    ..Default::default()
                },
                InferBatchStatistics {
                    batch_size: 4,
                    compute_infer: duration(1, 9),
                    ..Default::default()
                },
            ],
            ..Default::default()
        };
        let mut total = empty();
        add(&mut total, &a);
        add(&mut total, &b);
        assert_eq!(
            (total.last_inference, total.inference_count, total.execution_count),
            (10, 4, 3)
        );
        let stages = total.inference_stats.unwrap();
        assert_eq!(stages.success, duration(4, 350));
        assert_eq!(stages.fail, duration(1, 5));
        assert_eq!(stages.queue, duration(0, 0));
        assert_eq!(total.batch_stats.len(), 2);
        assert_eq!(total.batch_stats[0].compute_infer, duration(3, 21));
        assert_eq!(total.batch_stats[1].compute_infer, duration(1, 9));
    }
}
