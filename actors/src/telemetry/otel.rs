//! OpenTelemetry export of the daemon's tracing spans over OTLP/HTTP (protobuf), when an endpoint is
//! configured (`telemetry.otlp_endpoint` or `OTEL_EXPORTER_OTLP_ENDPOINT`). Without one nothing is
//! installed: the spans stay plain `tracing` spans, filtered like the logs.

/// Checks an OTLP/HTTP endpoint: `http://HOST:PORT` with an optional path (`/v1/traces` is appended
/// to a bare base URL, as the OTLP exporter specification says).
pub fn parse_endpoint(endpoint: &str) -> Result<String, String> {
    let Some(rest) = endpoint.strip_prefix("http://") else {
        return Err(format!(
            "{endpoint:?} is not an OTLP/HTTP endpoint like \"http://127.0.0.1:4318\" (https is not supported; put a collector on the host)"
        ));
    };
    let (authority, path) = rest.split_once('/').map_or((rest, ""), |(a, p)| (a, p));
    let port_ok =
        authority.rsplit_once(':').is_some_and(|(host, port)| !host.is_empty() && port.parse::<u16>().is_ok());
    if !port_ok {
        return Err(format!("{endpoint:?}: give host and port, like \"http://127.0.0.1:4318\""));
    }
    let path = path.trim_end_matches('/');
    Ok(if path.is_empty() { format!("http://{authority}/v1/traces") } else { format!("http://{authority}/{path}") })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints() {
        assert_eq!(parse_endpoint("http://127.0.0.1:4318").unwrap(), "http://127.0.0.1:4318/v1/traces");
        assert_eq!(parse_endpoint("http://c:4318/v1/traces").unwrap(), "http://c:4318/v1/traces");
        assert!(parse_endpoint("https://c:4318").is_err());
        assert!(parse_endpoint("http://c").is_err());
    }
}
