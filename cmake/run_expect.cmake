# ctest helper: runs DEMO with ARGS (arguments separated by |) and passes when its exit code is EXPECT_RC and its
# output (stdout + stderr) holds what the optional checks ask:
#   EXPECT_TEXT   a literal text it contains
#   EXPECT_REGEX  a regular expression it matches
#   VALUE_REGEX + VALUE_BELOW   VALUE_REGEX matches and its first capture group is a number below VALUE_BELOW
#   cmake -DDEMO=... -DARGS=a|b -DEXPECT_RC=2 -DEXPECT_TEXT=... -P run_expect.cmake
string(REPLACE "|" ";" ARGS "${ARGS}")
execute_process(COMMAND ${DEMO} ${ARGS} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
message("exit code ${rc}\n${out}${err}")
if(NOT rc STREQUAL "${EXPECT_RC}")
  message(FATAL_ERROR "expected exit code ${EXPECT_RC}, got ${rc}")
endif()
if(DEFINED EXPECT_TEXT)
  string(FIND "${out}${err}" "${EXPECT_TEXT}" pos)
  if(pos EQUAL -1)
    message(FATAL_ERROR "expected the output to name '${EXPECT_TEXT}'")
  endif()
endif()
if(DEFINED EXPECT_REGEX AND NOT "${out}${err}" MATCHES "${EXPECT_REGEX}")
  message(FATAL_ERROR "expected the output to match '${EXPECT_REGEX}'")
endif()
if(DEFINED VALUE_REGEX)
  if(NOT "${out}${err}" MATCHES "${VALUE_REGEX}")
    message(FATAL_ERROR "expected the output to match '${VALUE_REGEX}'")
  endif()
  set(value "${CMAKE_MATCH_1}")
  # CMake compares numbers as integers or as floating point (LESS reads both)
  if(NOT value LESS VALUE_BELOW)
    message(FATAL_ERROR "'${VALUE_REGEX}': ${value} is not below ${VALUE_BELOW}")
  endif()
endif()
